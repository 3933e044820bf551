"""The bootstrap HTTP channel, on a real KVSender: validation, error codes, no disturbed rooms."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio

from bench.tls_certs import make_certs
from pdserve.fsm import Room, RoomState
from pdserve.tls import TLSConfig
from pdserve.transport.bootstrap import (
    TOKEN_HEADER,
    BootstrapClient,
    PeerRejectedError,
    PeerUnreachableError,
)
from pdserve.transport.messages import HeartbeatMsg, RoomMsg
from pdserve.transport.receiver import KVReceiver
from pdserve.transport.sender import KVSender
from tests.transport.conftest import Endpoints, fill, outcome, pages_equal, until
from tests.transport.procs import free_port

LOCAL = "127.0.0.1"


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(
    http: aiohttp.ClientSession, sender: KVSender, path: str, body: Any
) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    url = f"http://{LOCAL}:{sender.bootstrap_port}{path}"
    async with http.post(url, data=data) as resp:
        return resp.status, orjson.loads(await resp.read())


async def waiting_room(
    endpoints: Endpoints, room_id: str = "live"
) -> tuple[KVSender, KVReceiver, Room]:
    """A sender and a registered receiver sharing one room in WaitingForInput."""
    sender, _ = await endpoints.sender()
    receiver, _ = await endpoints.receiver()
    sender.open_room(room_id, "req")
    room = await receiver.open_room(room_id, "req", LOCAL, sender.bootstrap_port, [4, 5], 20)
    await until(lambda: room.state == RoomState.WAITING_FOR_INPUT.value, what="pages posted")
    return sender, receiver, room


def room_body(receiver: KVReceiver, **overrides: Any) -> dict[str, Any]:
    cfg = receiver.config
    return {**RoomMsg(cfg.engine_id, cfg.incarnation, 999, [1], 10).to_dict(), **overrides}


@pytest.mark.parametrize(
    "path, body",
    [
        ("/rooms/live", b"{not json"),
        ("/rooms/live", [1, 2, 3]),
        ("/rooms/live", {"engine_id": "decode-0"}),
        ("/register", {"engine_id": 5}),
        ("/abort/live", {"engine_id": "decode-0", "incarnation": "x", "nonce": -1, "reason": "r"}),
        ("/heartbeat", b""),
    ],
)
async def test_malformed_message_gets_400_and_disturbs_no_room(
    endpoints: Endpoints, http: aiohttp.ClientSession, path: str, body: Any
) -> None:
    sender, receiver, room = await waiting_room(endpoints)
    status, reply = await post(http, sender, path, body)
    assert status == 400 and reply["error"]["code"] == "bad_request"
    assert reply["error"]["message"]  # says what is wrong
    assert sender.stats["bad_requests"] == 1
    assert sender.table.get("live").state == RoomState.WAITING_FOR_INPUT.value
    fill(sender.pool, [0, 1], seed=3)
    assert sender.send("live", [0, 1], 20, first_token=8)
    assert (await outcome(room)).state == RoomState.SUCCESS


async def test_page_ids_beyond_the_decode_pool_are_rejected(
    endpoints: Endpoints, http: aiohttp.ClientSession
) -> None:
    sender, receiver, _ = await waiting_room(endpoints)
    status, reply = await post(http, sender, "/rooms/other", room_body(receiver, page_ids=[64]))
    assert (status, reply["error"]["code"]) == (400, "bad_page_ids")
    assert "other" not in sender.table


async def test_second_page_post_for_a_live_room_is_409_and_does_not_alias(
    endpoints: Endpoints, http: aiohttp.ClientSession
) -> None:
    sender, receiver, room = await waiting_room(endpoints)
    status, reply = await post(http, sender, "/rooms/live", room_body(receiver, page_ids=[9]))
    assert (status, reply["error"]["code"]) == (409, "duplicate_room")
    assert sender.table.get("live").data["dst"] == [4, 5]  # the first post's pages stand
    fill(sender.pool, [0, 1], seed=4)
    assert sender.send("live", [0, 1], 20, first_token=8)
    assert (await outcome(room)).state == RoomState.SUCCESS
    assert pages_equal(sender.pool, [0, 1], receiver.pool, [4, 5])


async def test_unregistered_engine_must_register_first(
    endpoints: Endpoints, http: aiohttp.ClientSession
) -> None:
    sender, _ = await endpoints.sender()
    body = RoomMsg("decode-9", "nobody", 1, [1], 10).to_dict()
    status, reply = await post(http, sender, "/rooms/x", body)
    assert (status, reply["error"]["code"]) == (404, "unknown_peer")
    status, reply = await post(http, sender, "/heartbeat", HeartbeatMsg("decode-9", "n").to_dict())
    assert status == 200 and reply["is_known"] is False


async def test_restarted_decode_replaces_its_old_incarnation_whose_messages_get_409(
    endpoints: Endpoints, http: aiohttp.ClientSession
) -> None:
    sender, old, old_room = await waiting_room(endpoints)
    old_hb = HeartbeatMsg(old.config.engine_id, old.config.incarnation).to_dict()
    new, _ = await endpoints.receiver("decode-0")  # same engine id, new incarnation
    sender.open_room("fresh", "req")
    room = await new.open_room("fresh", "req", LOCAL, sender.bootstrap_port, [1], 10)
    out = await outcome(old_room)  # the sender told the old life its room ended
    assert out.state == RoomState.FAILED
    assert sender.table.get("live") is None
    status, reply = await post(http, sender, "/heartbeat", old_hb)
    assert (status, reply["error"]["code"]) == (409, "stale_incarnation")
    status, reply = await post(http, sender, "/rooms/x", room_body(old))
    assert status == 409 and sender.stats["stale_rejected"] >= 2
    assert [p["incarnation"] for p in sender.debug_peers()] == [new.config.incarnation]
    await until(lambda: not sender.agent.has_peer(old.agent.name), what="old metadata removed")
    assert sender.send("fresh", [2], 10, first_token=3)
    assert (await outcome(room)).state == RoomState.SUCCESS


async def test_peers_endpoint_lists_registered_decodes(
    endpoints: Endpoints, http: aiohttp.ClientSession
) -> None:
    sender, receiver, _ = await waiting_room(endpoints)
    async with http.get(f"http://{LOCAL}:{sender.bootstrap_port}/peers") as resp:
        peers = orjson.loads(await resp.read())
    assert resp.status == 200
    assert [(p["agent_name"], p["num_rooms"]) for p in peers] == [(receiver.agent.name, 1)]


async def test_client_maps_refusal_and_rejection_to_distinct_errors(endpoints: Endpoints) -> None:
    sender, _ = await endpoints.sender()
    client = BootstrapClient(connect_timeout_s=0.5, request_timeout_s=1.0)
    await client.start()
    try:
        with pytest.raises(PeerUnreachableError):
            await client.heartbeat(LOCAL, free_port(), HeartbeatMsg("d", "i"), 0.5)
        with pytest.raises(PeerRejectedError) as err:
            await client.post_room(LOCAL, sender.bootstrap_port, "x", RoomMsg("d", "i", 1, [1], 1))
        assert (err.value.status, err.value.code) == (404, "unknown_peer")
    finally:
        await client.close()


async def test_metadata_nixl_cannot_load_is_a_400_and_the_server_keeps_serving(
    endpoints: Endpoints, http: aiohttp.ClientSession
) -> None:
    sender, receiver, room = await waiting_room(endpoints)
    body = {
        "engine_id": "decode-7",
        "incarnation": "x",
        "agent_name": "decode-7@x",
        "metadata_b64": base64.b64encode(b"definitely not nixl metadata").decode(),
        "descriptor": receiver.agent.descriptor.to_json(),
        "layout": receiver.layout.to_dict(),
    }
    status, reply = await post(http, sender, "/register", body)
    assert (status, reply["error"]["code"]) == (400, "bad_metadata")
    assert [p["engine_id"] for p in sender.debug_peers()] == ["decode-0"]
    assert sender.send("live", [0, 1], 20, first_token=8)
    assert (await outcome(room)).state == RoomState.SUCCESS


async def test_a_token_protected_bootstrap_port_refuses_requests_without_the_token(
    endpoints: Endpoints, http: aiohttp.ClientSession
) -> None:
    sender, _ = await endpoints.sender(bootstrap_token="s3cret")
    base = f"http://{LOCAL}:{sender.bootstrap_port}"
    for headers in ({}, {TOKEN_HEADER: "wrong"}, {TOKEN_HEADER: "s3cre"}):
        async with http.get(f"{base}/peers", headers=headers) as resp:
            reply = orjson.loads(await resp.read())
        assert (resp.status, reply["error"]["code"]) == (401, "unauthorized")
        assert "--bootstrap-token" in reply["error"]["message"]
    assert sender._server.stats.unauthorized == 3
    async with http.get(f"{base}/peers", headers={TOKEN_HEADER: "s3cret"}) as resp:
        assert resp.status == 200


async def test_a_decode_with_the_token_pairs_and_one_without_fails_its_room(
    endpoints: Endpoints,
) -> None:
    sender, _ = await endpoints.sender(bootstrap_token="s3cret")
    good, _ = await endpoints.receiver("decode-good", bootstrap_token="s3cret")
    bad, _ = await endpoints.receiver("decode-bad", bootstrap_token="guess")
    sender.open_room("ok", "req")
    room = await good.open_room("ok", "req", LOCAL, sender.bootstrap_port, [4, 5], 20)
    await until(lambda: room.state == RoomState.WAITING_FOR_INPUT.value, what="pages posted")
    refused = await bad.open_room("no", "req", LOCAL, sender.bootstrap_port, [6], 10)
    await until(lambda: refused.is_terminal, what="the refused room ends")
    assert refused.state == RoomState.FAILED.value
    assert "unauthorized" in (refused.reason or ""), refused.reason
    assert [p["engine_id"] for p in sender.debug_peers()] == ["decode-good"]


async def test_a_tls_bootstrap_port_pairs_a_decode_speaking_https_and_fails_a_plain_one(
    endpoints: Endpoints, tmp_path: Path
) -> None:
    certs = make_certs(tmp_path)
    served = TLSConfig(str(certs.cert), str(certs.key), str(certs.ca))
    sender, _ = await endpoints.sender(tls=served)
    good, _ = await endpoints.receiver("decode-tls", tls=served)
    plain, _ = await endpoints.receiver("decode-plain")
    sender.open_room("ok", "req")
    room = await good.open_room("ok", "req", LOCAL, sender.bootstrap_port, [4, 5], 20)
    await until(lambda: room.state == RoomState.WAITING_FOR_INPUT.value, what="pages posted")
    assert sender.send("ok", [0, 1], 20, first_token=8)
    assert (await outcome(room)).state == RoomState.SUCCESS
    refused = await plain.open_room("no", "req", LOCAL, sender.bootstrap_port, [6], 10)
    await until(lambda: refused.is_terminal, what="the plain-HTTP room ends")
    assert refused.state == RoomState.FAILED.value
    assert [p["engine_id"] for p in sender.debug_peers()] == ["decode-tls"]
