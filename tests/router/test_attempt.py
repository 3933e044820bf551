"""One attempt over live worker doubles: both legs, first byte, cancels and aborts, streaming."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from pdserve.router.attempt_types import build_leg_bodies
from tests.router.helpers import CHAT, post, sse_events


def test_leg_bodies_share_room_and_prefill_never_streams():
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    kv = {"room_id": "r1", "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}
    prefill, decode = (orjson.loads(b) for b in build_leg_bodies(body, kv))
    assert prefill["kv_transfer_params"] == decode["kv_transfer_params"] == kv
    assert prefill["stream"] is False and "stream_options" not in prefill
    assert decode["stream"] is True and decode["stream_options"] == {"include_usage": True}
    assert prefill["messages"] == decode["messages"] == CHAT["messages"]


async def test_pd_dispatch_sends_both_legs_same_room_and_prefill_bootstrap(
    make_worker, make_router
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    status, raw = await post(router, {**CHAT, "stream": True}, rid="req-1")
    assert status == 200
    assert len(prefill.requests) == len(decode.requests) == 1
    p, d = prefill.requests[0], decode.requests[0]
    assert p.request_id == d.request_id == "req-1"
    kv = d.body["kv_transfer_params"]
    assert p.body["kv_transfer_params"] == kv
    assert kv["bootstrap_host"] == "127.0.0.1" and kv["bootstrap_port"] == prefill.bootstrap_port
    assert len(kv["room_id"]) == 32
    assert p.body["stream"] is False and d.body["stream"] is True
    events = sse_events(raw)
    assert events[-1] == b"[DONE]" and len(events) == decode.num_chunks + 2


async def test_prefill_failure_cancels_decode_leg_and_aborts_it(
    make_worker, make_router, wait_until
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.fail_status = 500
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(decode.url,), max_attempts=1
    )
    status, raw = await post(router, {**CHAT, "stream": True}, rid="pf-1")
    assert status == 500  # the worker's own error reply, passed on after the last attempt
    assert b"told to fail" in raw
    await wait_until(lambda: "pf-1" in decode.aborts and "pf-1" in decode.cancelled)
    assert prefill.aborts == []  # it answered with an error: it already ended the request


async def test_unreachable_decode_cancels_prefill_leg_and_aborts_it(
    make_worker, make_router, wait_until
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.is_hanging = True  # like a prefill waiting for the decode's destination pages
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(decode.url,), max_attempts=1
    )
    await decode.stop()  # dies after the router saw it healthy
    status, _ = await post(router, CHAT, rid="du-1")
    assert status == 502
    await wait_until(lambda: "du-1" in prefill.aborts and "du-1" in prefill.cancelled)


async def test_first_byte_timeout_retries_elsewhere_and_aborts_both_legs(
    make_worker, make_router, wait_until
):
    stuck = await make_worker("prefill")
    good = await make_worker("prefill")
    decode = await make_worker("decode")
    stuck.is_hanging = True
    router = await make_router(
        prefill_urls=(stuck.url, good.url), decode_urls=(decode.url,), first_byte_timeout_s=0.3
    )
    status, _ = await post(router, CHAT, rid="fb-1")
    assert status == 200
    assert good.rids() == ["fb-1.1"]
    await wait_until(lambda: "fb-1" in stuck.aborts and "fb-1" in decode.aborts)


async def test_no_retry_after_first_byte_stream_ends_with_error_event(make_worker, make_router):
    p1, p2 = await make_worker("prefill"), await make_worker("prefill")
    d1, d2 = await make_worker("decode"), await make_worker("decode")
    d1.die_after_chunks = d2.die_after_chunks = 2
    router = await make_router(
        prefill_urls=(p1.url, p2.url), decode_urls=(d1.url, d2.url), migration_limit=0
    )  # with migration on, tests/router/test_migration.py
    status, raw = await post(router, {**CHAT, "stream": True}, rid="na-1")
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    assert b'"error"' in events[-2] and b"stream_broken" in events[-2]
    assert len(events) == 4  # two token chunks, the error event, [DONE]
    assert len(d1.requests) + len(d2.requests) == 1  # not retried
    assert "return_token_ids" not in (d1.requests + d2.requests)[0].body
    assert router.stats.num_retries == 0
    assert router.stats.requests_by_status["stream_error"] == 1


async def test_stream_that_starts_with_error_event_is_retried(make_worker, make_router):
    prefill = await make_worker("prefill")
    broken, good = await make_worker("decode"), await make_worker("decode")
    broken.is_sse_error_first = True
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(broken.url, good.url))
    status, raw = await post(router, {**CHAT, "stream": True}, rid="se-1")
    assert status == 200 and b"engine failed" not in raw
    assert broken.rids() == ["se-1"] and good.rids() == ["se-1.1"]


async def test_client_4xx_from_worker_is_returned_as_is_and_not_retried(
    make_worker, make_router, wait_until
):
    prefill = await make_worker("prefill")
    prefill.is_hanging = True
    d1, d2 = await make_worker("decode"), await make_worker("decode")
    d1.fail_status = d2.fail_status = 422
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(d1.url, d2.url))
    status, raw = await post(router, CHAT, rid="cx-1")
    assert status == 422
    assert orjson.loads(raw)["error"]["message"] == "told to fail with 422"
    assert len(d1.requests) + len(d2.requests) == 1
    assert router.stats.num_retries == 0
    await wait_until(lambda: "cx-1" in prefill.aborts)  # the other leg is not left hanging
    breakers = [w.breaker for w in router.workers.all()]
    assert all(b.state == "closed" and b.num_failures == 0 for b in breakers)


async def test_client_disconnect_before_first_byte_aborts_both_legs(
    make_worker, make_router, wait_until
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.is_hanging = True
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    task = asyncio.create_task(post(router, {**CHAT, "stream": True}, rid="cd-1"))
    await wait_until(lambda: prefill.requests and decode.requests)
    task.cancel()
    await wait_until(lambda: "cd-1" in prefill.aborts and "cd-1" in decode.aborts)
    await wait_until(lambda: "cd-1" in prefill.cancelled and "cd-1" in decode.cancelled)
    await wait_until(lambda: router.stats.num_client_disconnects == 1)
    assert all(w.num_in_flight == 0 for w in router.workers.all())


async def test_client_disconnect_mid_stream_aborts_both_legs(make_worker, make_router, wait_until):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    decode.gate = asyncio.Semaphore(0)  # the stream stalls after its first chunk
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            router.url + "/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"X-Request-Id": "cm-1"},
        )
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert b"t0" in first
        resp.close()
    await wait_until(lambda: "cm-1" in decode.aborts and "cm-1" in prefill.aborts)
    await wait_until(lambda: "cm-1" in decode.cancelled)
    await wait_until(lambda: all(w.num_in_flight == 0 for w in router.workers.all()))
    assert router.stats.requests_by_status["499"] == 1


async def test_stream_stalled_after_first_byte_ends_with_error_within_request_timeout(
    make_worker, make_router, wait_until
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    decode.gate = asyncio.Semaphore(0)  # never released: the stream stalls after one chunk
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(decode.url,), request_timeout_s=0.5
    )
    status, raw = await asyncio.wait_for(post(router, {**CHAT, "stream": True}, rid="st-1"), 5)
    events = sse_events(raw)
    assert status == 200 and b"t0" in events[0]
    assert b"stream_broken" in events[-2] and events[-1] == b"[DONE]"
    await wait_until(lambda: "st-1" in decode.aborts)


async def test_client_hanging_up_right_after_done_is_not_a_disconnect(
    make_worker, make_router, wait_until
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    decode.is_holding_after_done = True  # [DONE] is out, the body's end is not yet
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    async with aiohttp.ClientSession() as session:
        resp = await session.post(
            router.url + "/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers={"X-Request-Id": "hd-1"},
        )
        while (line := await asyncio.wait_for(resp.content.readline(), 5)) != b"data: [DONE]\n":
            assert line  # not EOF before [DONE]
        resp.close()
    await wait_until(lambda: router.stats.requests_by_status["200"] == 1)
    assert router.stats.num_client_disconnects == 0
    assert decode.aborts == [] and prefill.aborts == []


async def test_peer_failure_reply_is_retried_without_tripping_the_workers_breaker(
    make_worker, make_router
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.fail_status, prefill.fail_code = 503, "transfer_error"
    # enforce_disagg: the retry goes to the same pair, not to the decode alone.
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(decode.url,), max_attempts=2,
        breaker_failures=1, enforce_disagg=True,
    )  # fmt: skip
    status, raw = await post(router, CHAT, rid="pl-1")
    assert status == 503 and b"told to fail" in raw
    assert router.stats.num_retries == 1
    breaker = next(w.breaker for w in router.workers.all() if w.url == prefill.url)
    assert breaker.state == "closed" and breaker.num_failures == 0
