"""The router and drains and load: a draining worker's 503 is retried elsewhere and takes it
out at once; reported load steers least_loaded and the 429 admission check; the router drains
its own streams on drain()."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from .helpers import CHAT, post, sse_events

FREE = {"free_pages": 100, "page_size": 16, "num_requests": 0, "waiting": 0}


async def test_a_draining_decode_is_retried_elsewhere_and_taken_out_without_a_breaker_failure(
    make_worker, make_router
):
    prefill = await make_worker("prefill")
    draining, good = await make_worker("decode"), await make_worker("decode")
    draining.fail_status, draining.fail_code = 503, "draining"
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(draining.url, good.url), breaker_failures=1
    )
    status, body = await post(router, CHAT)
    assert status == 200, body
    assert len(draining.requests) == 1 and len(good.requests) == 1
    worker = router.workers.get(draining.url)
    assert worker is not None and not worker.is_healthy and worker.last_error == "draining"
    assert worker.breaker.num_failures == 0
    for _ in range(3):  # out of rotation until a probe finds it ready again
        assert (await post(router, CHAT))[0] == 200
    assert len(draining.requests) == 1
    draining.fail_status = None
    await router.health.check_all()
    assert router.workers.get(draining.url).is_healthy


async def test_least_loaded_follows_the_reported_load(make_worker, make_router):
    prefill = await make_worker("prefill")
    busy, idle = await make_worker("decode"), await make_worker("decode")
    busy.load = {**FREE, "num_requests": 9, "running": 9}
    idle.load = {**FREE, "num_requests": 1, "running": 1}
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(busy.url, idle.url), policy="least_loaded"
    )
    for _ in range(4):
        assert (await post(router, CHAT))[0] == 200
    assert (len(busy.requests), len(idle.requests)) == (0, 4)


async def test_no_decode_with_room_answers_429_at_once_and_computes_nothing(
    make_worker, make_router
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    decode.load = {**FREE, "free_pages": 1}  # 16 tokens of room; the request wants 64
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    async with (
        aiohttp.ClientSession() as session,
        session.post(router.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 64}) as r,
    ):
        status, retry_after, body = r.status, r.headers.get("Retry-After"), await r.read()
    assert status == 429 and retry_after is not None and retry_after.isdigit()
    error = orjson.loads(body)["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
    assert "KV pages" in error["message"]
    assert prefill.requests == [] and decode.requests == []
    # One that fits goes: 15 out + its prompt "hi", one token by the worker's /tokenize count.
    assert (await post(router, {**CHAT, "max_tokens": 15}))[0] == 200
    assert (await post(router, {**CHAT, "max_tokens": 16}))[0] == 429
    assert len(prefill.tokenized) == 2
    # Over the context window (4096): the worker's own 400 is the answer, not a 429.
    assert (await post(router, {**CHAT, "max_tokens": 10**6}))[0] == 200  # the fake serves it
    _, metrics = await _get(router.url + "/metrics")
    assert b"pdserve_router_requests_shed_total 2.0" in metrics


async def test_router_drain_finishes_streams_and_turns_new_requests_away(
    make_worker, make_router, wait_until
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    decode.gate = asyncio.Semaphore(0)
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    streaming = asyncio.ensure_future(post(router, {**CHAT, "stream": True}))
    await wait_until(lambda: router._dispatcher is not None and router._dispatcher.num_active)
    drained = asyncio.ensure_future(router.drain())
    await wait_until(lambda: router.is_draining)
    status, body = await post(router, CHAT)
    assert status == 503 and orjson.loads(body)["error"]["code"] == "draining"
    assert (await _get(router.url + "/health/ready"))[0] == 503
    assert not drained.done()
    for _ in range(decode.num_chunks):
        decode.gate.release()
    status, raw = await streaming
    assert status == 200 and sse_events(raw)[-1] == b"[DONE]"
    assert await asyncio.wait_for(drained, 5.0) is True


async def _get(url: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.read()


async def test_when_every_decode_drains_the_client_gets_the_retryable_503_with_retry_after(
    make_worker, make_router
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    decode.fail_status, decode.fail_code = 503, "draining"
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    async with (
        aiohttp.ClientSession() as session,
        session.post(router.url + "/v1/chat/completions", json=CHAT) as resp,
    ):
        status, retry_after, body = resp.status, resp.headers.get("Retry-After"), await resp.read()
    assert status == 503 and retry_after is not None and retry_after.isdigit()
    assert orjson.loads(body)["error"]["code"] in ("draining", "upstream_failed")
    assert (await _get(router.url + "/health/ready"))[0] == 503  # out of rotation at once
