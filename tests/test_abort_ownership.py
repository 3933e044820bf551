"""A client aborts only its own requests (pdserve/auth.py owner tags), on a worker and on the
router: another client's abort of a live request id is a 404, as for an id that does not exist,
and the request completes; its own client, or the admin, can abort it."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import aiohttp
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from pdserve.api import build_app
from pdserve.auth import AccessPolicy, Credentials, Denial, owner_tag
from pdserve.router import Router
from tests.api.conftest import chat_body, make_config, wait_until
from tests.api.engine_double import FakeEngine
from tests.router.conftest import TEST_CONFIG, FakeWorker, KVBoard
from tests.router.helpers import CHAT

ALICE, BOB, ADMIN = "alice-key", "bob-key", "admin-key"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_worker_refuses_one_clients_abort_of_anothers_request_and_it_completes() -> None:
    engine = FakeEngine()
    engine.hang_after = 2  # the request waits after two tokens, until resumed or aborted
    config = make_config(api_key=(ALICE, BOB), admin_api_key=ADMIN)
    app = build_app(engine, config, CollectorRegistry())
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        headers = {**bearer(ALICE), "X-Request-Id": "alice-1"}
        body = chat_body("hello", max_tokens=5)
        alice = asyncio.ensure_future(
            client.post("/v1/chat/completions", json=body, headers=headers)
        )
        await wait_until(lambda: "alice-1" in engine.live)
        resp = await client.post("/abort/alice-1", headers=bearer(BOB))
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "not_found"
        missing = await client.post("/abort/no-such-id", headers=bearer(BOB))
        assert missing.status == 404  # the same answer: no oracle for others' ids
        engine.resume()
        done = await alice
        assert done.status == 200
        reply = await done.json()
        assert reply["choices"][0]["finish_reason"] == "length"
        assert engine.aborted_ids() == set()


async def test_a_worker_lets_the_owner_and_the_admin_abort() -> None:
    engine = FakeEngine()
    engine.hang_after = 1
    config = make_config(api_key=(ALICE, BOB), admin_api_key=ADMIN)
    app = build_app(engine, config, CollectorRegistry())
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        for rid, aborter in (("own-1", ALICE), ("admin-1", ADMIN)):
            headers = {**bearer(ALICE), "X-Request-Id": rid}
            task = asyncio.ensure_future(
                client.post("/v1/chat/completions", json=chat_body(), headers=headers)
            )
            await wait_until(lambda rid=rid: rid in engine.live)
            resp = await client.post(f"/abort/{rid}", headers=bearer(aborter))
            assert resp.status == 200 and (await resp.json())["aborted"] is True
            await task
        assert {"own-1", "admin-1"} <= engine.aborted_ids()


async def test_the_router_refuses_one_clients_abort_of_anothers_request_and_it_completes():
    board = KVBoard()
    prefill, decode = (
        FakeWorker("prefill", board, bootstrap_port=18998),
        FakeWorker("decode", board),
    )
    for w in (prefill, decode):
        await w.start()
    decode.gate = asyncio.Semaphore(0)  # the stream stalls after its first chunk
    config = replace(
        TEST_CONFIG, prefill_urls=(prefill.url,), decode_urls=(decode.url,),
        api_key=(ALICE, BOB), admin_api_key=ADMIN, worker_api_key="worker-key",
    )  # fmt: skip
    router = Router(config, rng=random.Random(0))
    await router.start()
    try:
        await router.health.check_all()
        async with aiohttp.ClientSession() as session:

            async def alice_stream() -> tuple[int, bytes]:
                body = {**CHAT, "stream": True}
                async with session.post(
                    router.url + "/v1/chat/completions", json=body, headers=bearer(ALICE)
                ) as resp:
                    return resp.status, await resp.read()

            alice = asyncio.ensure_future(alice_stream())
            await wait_until(lambda: decode.requests)
            rid = decode.requests[0].request_id
            assert rid.startswith("chatcmpl-") and len(rid) >= len("chatcmpl-") + 32
            async with session.post(f"{router.url}/abort/{rid}", headers=bearer(BOB)) as resp:
                assert resp.status == 404
            async with session.get(router.url + "/debug/requests", headers=bearer(BOB)) as resp:
                assert resp.status == 403  # no listing of others' ids for a client
            for _ in range(decode.num_chunks):
                decode.gate.release()
            status, raw = await alice
            assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
            assert b'"finish_reason":"length"' in raw and not decode.aborts
    finally:
        await router.stop()
        for w in (prefill, decode):
            await w.stop()


def test_owner_tags_are_per_key_hashes_and_keys_must_differ_by_role() -> None:
    assert owner_tag(ALICE) != owner_tag(BOB) and ALICE not in owner_tag(ALICE)
    try:
        Credentials((ALICE,), admin_api_key=ALICE)
    except ValueError as exc:
        assert "must all differ" in str(exc)
    else:
        raise AssertionError("a client key that is also the admin key was accepted")


def test_without_an_admin_key_admin_routes_answer_only_loopback(caplog) -> None:
    policy = AccessPolicy(Credentials((ALICE,)), {"/drain": "admin"}, "worker")
    with caplog.at_level("WARNING", logger="pdserve.auth"):
        policy.log_warnings()
    assert "no --admin-api-key" in caplog.text
    assert policy.decide("admin", None, "127.0.0.1").role == "admin"
    assert policy.decide("admin", None, "::1").role == "admin"
    for remote in ("10.1.2.3", "192.0.2.7", None):
        refused = policy.decide("admin", f"Bearer {ALICE}", remote)
        assert isinstance(refused, Denial) and refused.status == 403
        assert refused.code == "admin_loopback_only"
    # A remote client still aborts its own requests (and only those, in the handler).
    assert policy.decide("abort", f"Bearer {ALICE}", "10.1.2.3").owner == owner_tag(ALICE)
