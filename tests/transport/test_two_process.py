"""KV rooms across two real processes (prefill sender, decode receiver) over real NIXL.

Each side runs tests/transport/driver.py; the sender injects a 0.2 s delay before every
one-page chunk (inside the write window), which makes "mid-transfer" a wide, deterministic window.
Every test ends with all pages back in both processes' allocators.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio

from tests.transport.procs import DriverProc, free_port

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

LOCAL = "127.0.0.1"
HB = 0.2  # the liveness tests' heartbeat interval
NUM_PAGES = 256  # driver default pool size
SENDER_OPTS: dict[str, Any] = dict(hb=HB, delay=0.2, chunk_pages=1, deadlines="6,6,6")
RECEIVER_OPTS: dict[str, Any] = dict(hb=HB, quarantine=0.5, deadlines="6,6,6")
# The shared pair does not test liveness: a calmer heartbeat keeps a CPU-starved CI box (load
# far above its core count) from declaring a live peer dead in the middle of another test.
PAIR_HB = 1.0


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair() -> AsyncIterator[tuple[DriverProc, DriverProc]]:
    sender, receiver = await asyncio.gather(
        DriverProc.spawn("sender", "prefill-0", **{**SENDER_OPTS, "hb": PAIR_HB}),
        DriverProc.spawn("receiver", "decode-0", **{**RECEIVER_OPTS, "hb": PAIR_HB}),
    )
    yield sender, receiver
    await asyncio.gather(sender.close(), receiver.close())


async def open_both(
    sender: DriverProc, receiver: DriverProc, room: str, num_pages: int, decode_first: bool = False
) -> None:
    async def prefill() -> None:
        assert (await sender.cmd("open", room=room))["ok"]

    async def decode() -> None:
        reply = await receiver.cmd(
            "open", room=room, host=LOCAL, port=sender.port, num_pages=num_pages
        )
        assert reply["ok"], reply

    first, second = (decode, prefill) if decode_first else (prefill, decode)
    await first()
    await second()


async def all_pages_free(*procs: DriverProc, within_s: float = 5.0) -> None:
    """Poll each process until its allocator holds every page again."""
    deadline = time.monotonic() + within_s
    for proc in procs:
        while (stats := await proc.cmd("stats"))["num_free"] != NUM_PAGES:
            assert time.monotonic() < deadline, f"{proc.name} leaked pages: {stats}"
            await asyncio.sleep(0.02)
        assert stats["num_live"] == 0


async def test_kv_pages_move_across_processes_and_bytes_match(
    pair: tuple[DriverProc, DriverProc],
) -> None:
    sender, receiver = pair
    for room, scatter in (("contig", False), ("scatter", True)):
        await open_both(sender, receiver, room, num_pages=4)
        sent = await sender.cmd(
            "send", room=room, num_pages=4, seed=11, token=1234, scatter=scatter
        )
        assert sent["ok"]
        done = await receiver.wait_event("done", room=room)
        assert done["state"] == "Success" and done["first_token"] == 1234
        assert done["digest"] == sent["digest"]
        assert (await sender.wait_event("done", room=room))["state"] == "Success"
    await all_pages_free(sender, receiver)


async def test_many_rooms_in_flight_at_once(pair: tuple[DriverProc, DriverProc]) -> None:
    sender, receiver = pair
    rooms = [f"many-{i}" for i in range(24)]
    await asyncio.gather(
        *(open_both(sender, receiver, r, 3, decode_first=i % 2 == 1) for i, r in enumerate(rooms))
    )
    sent = await asyncio.gather(
        *(sender.cmd("send", room=r, num_pages=3, seed=i, token=i) for i, r in enumerate(rooms))
    )
    for i, room in enumerate(rooms):
        done = await receiver.wait_event("done", room=room, within_s=15.0)
        assert (done["state"], done["first_token"], done["digest"]) == (
            "Success",
            i,
            sent[i]["digest"],
        )
    stats = (await sender.cmd("stats"))["stats"]
    assert stats["peak_writes_outstanding"] >= 12  # the transfers really overlapped
    await all_pages_free(sender, receiver)


async def test_abort_before_bootstrap_ends_both_rooms(pair: tuple[DriverProc, DriverProc]) -> None:
    sender, receiver = pair
    # Prefill side aborts before the decode ever showed up.
    assert (await sender.cmd("open", room="b1"))["ok"]
    assert (await sender.cmd("send", room="b1", num_pages=2, seed=1, token=1))["ok"]
    assert (await sender.cmd("abort", room="b1"))["ok"]
    await receiver.cmd("open", room="b1", host=LOCAL, port=sender.port, num_pages=2)
    done = await receiver.wait_event("done", room="b1")
    assert done["state"] == "Failed" and done["reason"].startswith("aborted: by prefill")
    assert (await sender.wait_event("done", room="b1"))["reason"].startswith("aborted")
    # Decode side aborts before its hand-shake ran; the prefill request arrives afterwards.
    reply = await receiver.cmd(
        "open", room="b2", host=LOCAL, port=sender.port, num_pages=2, abort_now=True
    )
    assert reply["ok"]
    assert (await receiver.wait_event("done", room="b2"))["reason"].startswith("aborted")
    await receiver.wait_event("release", room="b2")
    await sender.cmd("open", room="b2")
    done = await sender.wait_event("done", room="b2")
    assert done["state"] == "Failed" and done["reason"].startswith("aborted: by decode")
    await all_pages_free(sender, receiver)


async def test_abort_while_waiting_for_input_ends_both_rooms_either_direction(
    pair: tuple[DriverProc, DriverProc],
) -> None:
    sender, receiver = pair
    for room, aborter, other in (("w1", receiver, sender), ("w2", sender, receiver)):
        await open_both(sender, receiver, room, num_pages=2)
        assert (await receiver.cmd("wait_state", room=room, state="WaitingForInput"))["ok"]
        assert (await sender.cmd("wait_state", room=room, state="WaitingForInput"))["ok"]
        assert (await aborter.cmd("abort", room=room, reason="client left"))["ok"]
        for proc in (aborter, other):
            done = await proc.wait_event("done", room=room)
            assert done["state"] == "Failed" and done["reason"].startswith("aborted")
        await receiver.wait_event("release", room=room)
    await all_pages_free(sender, receiver)


async def test_abort_mid_transfer_frees_receiver_pages_only_after_the_sender_ack(
    pair: tuple[DriverProc, DriverProc],
) -> None:
    sender, receiver = pair
    for room, aborter in (("m1", receiver), ("m2", sender)):
        await open_both(sender, receiver, room, num_pages=4)
        assert (await sender.cmd("send", room=room, num_pages=4, seed=3, token=3))["ok"]
        assert (await receiver.cmd("wait_state", room=room, state="Transferring"))["ok"]
        assert (await aborter.cmd("abort", room=room))["ok"]
        r_done = await receiver.wait_event("done", room=room)
        s_done = await sender.wait_event("done", room=room)
        assert r_done["state"] == s_done["state"] == "Failed"
        s_release = await sender.wait_event("release", room=room)
        r_release = await receiver.wait_event("release", room=room)
        # The fence: the decode pages came back only after the sender's write window closed.
        assert r_release["t"] >= s_release["t"] > r_done["t"]
    stats = (await receiver.cmd("stats"))["stats"]
    assert stats["released_by_ack"] >= 2 and stats["released_by_quarantine"] == 0
    await all_pages_free(sender, receiver)


async def test_abort_after_success_changes_nothing(pair: tuple[DriverProc, DriverProc]) -> None:
    sender, receiver = pair
    await open_both(sender, receiver, "s1", num_pages=1)
    assert (await sender.cmd("send", room="s1", num_pages=1, seed=5, token=5))["ok"]
    assert (await receiver.wait_event("done", room="s1"))["state"] == "Success"
    assert (await sender.wait_event("done", room="s1"))["state"] == "Success"
    assert not (await receiver.cmd("abort", room="s1"))["ok"]
    assert not (await sender.cmd("abort", room="s1"))["ok"]
    assert receiver.find("release", room="s1") is None  # Success: the engine owns its pages
    await all_pages_free(sender, receiver)


async def test_duplicate_room_id_is_rejected_without_aliasing(
    pair: tuple[DriverProc, DriverProc],
) -> None:
    sender, receiver = pair
    await open_both(sender, receiver, "dup", num_pages=2)
    assert (await sender.cmd("open", room="dup"))["error"] == "duplicate"
    reply = await receiver.cmd("open", room="dup", host=LOCAL, port=sender.port, num_pages=2)
    assert reply["error"] == "duplicate"
    assert (await receiver.cmd("wait_state", room="dup", state="WaitingForInput"))["ok"]
    intruder = {
        "engine_id": "decode-0",
        "incarnation": receiver.incarnation,
        "nonce": 10**9,
        "page_ids": [0],
        "num_tokens": 16,
    }
    async with aiohttp.ClientSession() as http:
        url = f"http://{LOCAL}:{sender.port}/rooms/dup"
        async with http.post(url, data=orjson.dumps(intruder)) as resp:
            assert resp.status == 409
            assert orjson.loads(await resp.read())["error"]["code"] == "duplicate_room"
    sent = await sender.cmd("send", room="dup", num_pages=2, seed=8, token=8)
    done = await receiver.wait_event("done", room="dup")
    assert (done["state"], done["digest"]) == ("Success", sent["digest"])
    await all_pages_free(sender, receiver)


async def test_dead_bootstrap_address_fails_fast(pair: tuple[DriverProc, DriverProc]) -> None:
    _, receiver = pair
    started = time.monotonic()
    await receiver.cmd("open", room="dead", host=LOCAL, port=free_port(), num_pages=1)
    done = await receiver.wait_event("done", room="dead")
    assert done["state"] == "Failed" and done["reason"].startswith("bootstrap_error")
    assert done["t"] - started < 2.0  # connect_timeout_s=0.5, far below the 6 s deadline
    await receiver.wait_event("release", room="dead")


async def start_transfers(
    sender: DriverProc, receiver: DriverProc, rooms: list[str]
) -> dict[str, str]:
    """Open ``rooms`` on both sides and start their (slow) transfers; returns digests by room."""
    await asyncio.gather(*(open_both(sender, receiver, r, num_pages=4) for r in rooms))
    sent = {r: await sender.cmd("send", room=r, num_pages=4, seed=1, token=1) for r in rooms}
    for room in rooms:
        assert (await receiver.cmd("wait_state", room=room, state="Transferring"))["ok"]
    return {r: s["digest"] for r, s in sent.items()}


async def test_killed_receiver_fails_sender_rooms_and_a_restarted_one_works() -> None:
    # 1 s per chunk: the missed heartbeats, not a failing write, must be what notices the kill.
    sender, receiver = await asyncio.gather(
        DriverProc.spawn("sender", "prefill-0", **{**SENDER_OPTS, "delay": 1.0}),
        DriverProc.spawn("receiver", "decode-0", **RECEIVER_OPTS),
    )
    restarted: DriverProc | None = None
    try:
        rooms = ["k1", "k2", "k3"]
        await start_transfers(sender, receiver, rooms)
        await open_both(sender, receiver, "idle", num_pages=2)  # waiting for input
        assert (await sender.cmd("wait_state", room="idle", state="WaitingForInput"))["ok"]
        killed_at = time.monotonic()
        receiver.kill()
        for room in [*rooms, "idle"]:
            done = await sender.wait_event("done", room=room)
            assert done["state"] == "Failed" and done["reason"].startswith("peer_lost")
            # Two missed intervals, plus the sweep period and scheduling slack.
            assert done["t"] - killed_at <= 2 * HB + HB / 4 + 0.5, done["t"] - killed_at
        await all_pages_free(sender)
        restarted = await DriverProc.spawn("receiver", "decode-0", **RECEIVER_OPTS)
        assert restarted.incarnation != receiver.incarnation
        await open_both(sender, restarted, "after", num_pages=1)
        sent = await sender.cmd("send", room="after", num_pages=1, seed=2, token=2)
        done = await restarted.wait_event("done", room="after")
        assert (done["state"], done["digest"]) == ("Success", sent["digest"])
        peers = (await sender.cmd("stats"))["peers"]
        assert [p["incarnation"] for p in peers] == [restarted.incarnation]  # old one forgotten
        stale = orjson.dumps({"engine_id": "decode-0", "incarnation": receiver.incarnation})
        async with aiohttp.ClientSession() as http:
            url = f"http://{LOCAL}:{sender.port}/heartbeat"
            async with http.post(url, data=stale) as resp:
                assert resp.status == 409
                assert orjson.loads(await resp.read())["error"]["code"] == "stale_incarnation"
        await all_pages_free(sender, restarted)
    finally:
        await asyncio.gather(*(p.close() for p in (sender, receiver, restarted) if p is not None))


async def test_killed_sender_fails_receiver_rooms_and_a_restarted_one_works() -> None:
    port = free_port()
    sender, receiver = await asyncio.gather(
        DriverProc.spawn("sender", "prefill-0", port=port, **SENDER_OPTS),
        DriverProc.spawn("receiver", "decode-0", **RECEIVER_OPTS),
    )
    restarted: DriverProc | None = None
    try:
        rooms = ["q1", "q2"]
        await start_transfers(sender, receiver, rooms)
        killed_at = time.monotonic()
        sender.kill()
        for room in rooms:
            done = await receiver.wait_event("done", room=room)
            assert done["state"] == "Failed" and done["reason"].startswith("peer_lost")
            assert done["t"] - killed_at <= 2 * HB + 0.5, done["t"] - killed_at
            release = await receiver.wait_event("release", room=room)
            assert release["t"] - done["t"] >= 0.5 - 0.05  # dead sender: quarantine, not ack
        restarted = await DriverProc.spawn("sender", "prefill-0", port=port, **SENDER_OPTS)
        assert restarted.port == port and restarted.incarnation != sender.incarnation
        await open_both(restarted, receiver, "after", num_pages=2)
        sent = await restarted.cmd("send", room="after", num_pages=2, seed=4, token=4)
        done = await receiver.wait_event("done", room="after")
        assert (done["state"], done["digest"]) == ("Success", sent["digest"])
        stats = (await receiver.cmd("stats"))["stats"]
        assert stats["released_by_quarantine"] == 2 and stats["peers_lost"] == 1
        await all_pages_free(restarted, receiver)
    finally:
        await asyncio.gather(*(p.close() for p in (sender, receiver, restarted) if p is not None))
