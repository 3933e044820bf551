"""Peer registries and heartbeats: incarnations, staleness, loss detection, restarts."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.fsm import RoomState
from pdserve.transport.bootstrap import ProtocolError
from pdserve.transport.liveness import DecodePeer, DecodePeerManager
from pdserve.transport.messages import PoolDescMsg
from tests.transport.conftest import HB, Endpoints, outcome, until

LOCAL = "127.0.0.1"
DESC = PoolDescMsg(base_address=4096, page_bytes=4096, num_pages=8)


def peer(incarnation: str, now: float = 0.0) -> DecodePeer:
    return DecodePeer("decode-0", incarnation, f"decode-0@{incarnation}", DESC, now, now)


def test_only_the_current_incarnation_is_accepted_and_older_ones_are_stale() -> None:
    peers = DecodePeerManager(lost_after_s=0.4)
    with pytest.raises(ProtocolError) as err:
        peers.require("decode-0", "a", now=1.0)
    assert (err.value.status, err.value.code) == (404, "unknown_peer")
    assert peers.add(peer("a")) is None
    assert peers.require("decode-0", "a", now=1.0).last_seen == 1.0
    replaced = peers.add(peer("b"))
    assert replaced is not None and replaced.incarnation == "a"
    with pytest.raises(ProtocolError) as err:
        peers.require("decode-0", "a", now=2.0)
    assert (err.value.status, err.value.code) == (409, "stale_incarnation")
    assert peers.by_key("decode-0@b") is not None and peers.by_key("decode-0@a") is None


def test_a_forgotten_incarnation_may_return_until_a_newer_one_registers() -> None:
    peers = DecodePeerManager(lost_after_s=0.4)
    peers.add(peer("a"))
    assert peers.remove("decode-0@a") is not None  # lost: forgotten, not retired
    assert not peers.is_retired("decode-0", "a")
    assert peers.add(peer("a")) is None  # the partition healed: it registers again
    peers.remove("decode-0@a")
    peers.add(peer("b"))  # a restart after the loss still retires the earlier life
    assert peers.is_retired("decode-0", "a")


def test_peers_silent_for_two_intervals_are_expired() -> None:
    peers = DecodePeerManager(lost_after_s=0.4)
    peers.add(peer("a", now=10.0))
    assert peers.expired(now=10.39) == []
    assert [p.incarnation for p in peers.expired(now=10.41)] == ["a"]


async def test_sender_forgets_a_decode_that_stops_heartbeating(endpoints: Endpoints) -> None:
    sender, _ = await endpoints.sender()
    receiver, _ = await endpoints.receiver()
    sender.open_room("x", "req")
    room = await receiver.open_room("x", "req", LOCAL, sender.bootstrap_port, [1], 10)
    assert sender.send("x", [2], 10, first_token=1)
    assert (await outcome(room)).state == RoomState.SUCCESS
    assert len(sender.debug_peers()) == 1
    loop = asyncio.get_running_loop()
    await endpoints.stop(receiver)  # heartbeats stop
    stopped = loop.time()
    await until(lambda: sender.debug_peers() == [], within_s=3.0, what="decode forgotten")
    assert loop.time() - stopped <= 2 * HB + HB / 4 + 0.3
    assert sender.stats["peers_lost"] == 1
    await until(lambda: not sender.agent.has_peer(receiver.agent.name), what="metadata removed")


async def test_decode_notices_a_restarted_prefill_and_reregisters(endpoints: Endpoints) -> None:
    first, _ = await endpoints.sender()
    port = first.bootstrap_port
    receiver, _ = await endpoints.receiver()
    first.open_room("a", "req")
    room = await receiver.open_room("a", "req", LOCAL, port, [1], 10)
    await until(lambda: room.state == RoomState.WAITING_FOR_INPUT.value, what="registered")
    await endpoints.stop(first)
    # Its shutdown notification may be lost with its agent; missed heartbeats end it otherwise.
    assert (await outcome(room)).reason.startswith(("aborted: by prefill (shutdown", "peer_lost"))
    second, _ = await endpoints.sender(bootstrap_port=port)  # new incarnation, same address
    await until(lambda: receiver.stats["peers_lost"] == 1, within_s=3.0, what="restart seen")
    second.open_room("b", "req")
    room = await receiver.open_room("b", "req", LOCAL, port, [2], 10)
    assert second.send("b", [3], 10, first_token=4)
    assert (await outcome(room)).state == RoomState.SUCCESS
    assert [p["incarnation"] for p in receiver.debug_peers()] == [second.config.incarnation]
