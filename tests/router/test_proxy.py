"""The dispatcher over live worker doubles: retries, path choice, aborts, breaker, policies."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import orjson

from pdserve.router.proxy import backoff_s
from tests.router.helpers import CHAT, post, sse_events


def test_backoff_grows_exponentially_with_jitter_and_a_cap():
    rng = random.Random(3)
    for attempt_no, ceiling in [(1, 0.05), (2, 0.1), (3, 0.2), (4, 0.3), (9, 0.3)]:
        delays = [backoff_s(attempt_no, 0.05, 0.3, rng) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(set(delays)) == 50  # jittered, not lockstep


async def test_each_request_gets_a_fresh_room(make_worker, make_router):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    for _ in range(3):
        assert (await post(router, CHAT))[0] == 200
    rooms = {r.body["kv_transfer_params"]["room_id"] for r in decode.requests}
    assert len(rooms) == 3


async def test_retry_goes_to_another_pair_before_first_byte(make_worker, make_router):
    bad = await make_worker("prefill")
    good = await make_worker("prefill")
    decode = await make_worker("decode")
    bad.fail_status = 503
    router = await make_router(
        prefill_urls=(bad.url, good.url), decode_urls=(decode.url,), max_attempts=3
    )
    status, raw = await post(router, {**CHAT, "stream": True}, rid="rt-1")
    assert status == 200 and sse_events(raw)[-1] == b"[DONE]"
    assert bad.rids() == ["rt-1"]
    assert good.rids() == ["rt-1.1"]  # the retry carries its own request id
    assert decode.rids() == ["rt-1", "rt-1.1"]
    assert router.stats.num_retries == 1
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            router.url + "/v1/completions", json=CHAT, headers={"X-Request-Id": "rt-2"}
        ) as resp,
    ):
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "rt-2"  # not "rt-2.1"


async def test_abort_endpoint_forwards_to_legs_and_stops_retries(
    make_worker, make_router, wait_until
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.is_hanging = True
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    task = asyncio.create_task(post(router, CHAT, rid="ab-1"))
    await wait_until(lambda: prefill.requests and decode.requests)
    async with aiohttp.ClientSession() as session:
        async with session.post(router.url + "/abort/ab-1") as resp:
            assert resp.status == 200 and (await resp.json())["aborted"] is True
        async with session.post(router.url + "/abort/unknown") as resp:
            assert (await resp.json())["aborted"] is False
    status, _ = await asyncio.wait_for(task, 5)
    assert status == 503
    assert "ab-1" in prefill.aborts and "ab-1" in decode.aborts
    assert len(prefill.requests) == 1  # an aborted request is not retried


async def test_colocated_workers_are_load_balanced_without_kv_params(make_worker, make_router):
    w1, w2 = await make_worker("colocated"), await make_worker("colocated")
    router = await make_router(worker_urls=(w1.url, w2.url))
    for _ in range(4):
        status, raw = await post(router, {**CHAT, "stream": False})
        assert status == 200 and orjson.loads(raw)["object"] == "chat.completion"
    assert len(w1.requests) == len(w2.requests) == 2
    assert all("kv_transfer_params" not in r.body for r in w1.requests + w2.requests)


async def test_without_a_healthy_prefill_a_decode_prefills_the_request_itself(
    make_worker, make_router
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.is_ready = False  # fails its readiness probe: not available
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(decode.url,), is_ready_required=False
    )
    status, raw = await post(router, {**CHAT, "stream": False})
    assert status == 200, raw
    assert [("kv_transfer_params" in r.body) for r in decode.requests] == [False]
    assert prefill.requests == []
    assert router.stats.num_decode_fallbacks == 1


async def test_a_request_every_prefill_failed_is_retried_on_a_decode_alone(
    make_worker, make_router
):
    # A prefill killed a moment ago still looks healthy until the next probe.
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.fail_status = 503
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    status, raw = await post(router, {**CHAT, "stream": False}, rid="fb-1")
    assert status == 200, raw
    assert prefill.rids() == ["fb-1"] and decode.rids() == ["fb-1", "fb-1.1"]
    assert "kv_transfer_params" not in decode.requests[-1].body
    assert router.stats.num_decode_fallbacks == 1


async def test_enforce_disagg_retries_a_failed_prefill_rather_than_the_decode_alone(
    make_worker, make_router
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.fail_status = 503
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(decode.url,), enforce_disagg=True
    )
    assert (await post(router, CHAT, rid="fb-2"))[0] == 503
    assert len(prefill.requests) == router.config.max_attempts
    assert all("kv_transfer_params" in r.body for r in decode.requests)
    assert router.stats.num_decode_fallbacks == 0


async def test_enforce_disagg_answers_503_without_a_healthy_prefill(make_worker, make_router):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.is_ready = False
    router = await make_router(
        prefill_urls=(prefill.url,),
        decode_urls=(decode.url,),
        is_ready_required=False,
        enforce_disagg=True,
    )
    status, _ = await post(router, CHAT)
    assert status == 503 and decode.requests == []
    assert router.stats.num_decode_fallbacks == 0


async def test_no_healthy_path_answers_503(make_worker, make_router):
    prefill = await make_worker("prefill")
    router = await make_router(prefill_urls=(prefill.url,), is_ready_required=False)
    status, raw = await post(router, CHAT)
    assert status == 503
    assert orjson.loads(raw)["error"]["type"] == "service_unavailable"


async def test_breaker_opens_on_a_failing_worker_then_half_open_trial_closes_it(
    make_worker, make_router, wait_until
):
    bad, good = await make_worker("prefill"), await make_worker("prefill")
    decode = await make_worker("decode")
    bad.fail_status = 500
    router = await make_router(
        prefill_urls=(bad.url, good.url),
        decode_urls=(decode.url,),
        breaker_failures=2,
        breaker_reset_s=0.3,
    )
    breaker = router.workers.get(bad.url).breaker
    for _ in range(6):
        assert (await post(router, CHAT))[0] == 200  # every failure retried on the good one
        if breaker.state == "open":
            break
    assert breaker.state == "open" and len(bad.requests) == 2
    for _ in range(4):
        assert (await post(router, CHAT))[0] == 200
    assert len(bad.requests) == 2  # taken out while open
    await wait_until(lambda: breaker.state == "half_open", what="half-open after reset time")
    bad.fail_status = None  # it recovered; the trial request proves it
    for _ in range(4):
        assert (await post(router, CHAT))[0] == 200
        if len(bad.requests) == 3:
            break
    assert len(bad.requests) == 3 and breaker.state == "closed"
    assert router.stats.breaker_opens[bad.url] == 1


async def test_power_of_two_sends_to_the_decode_with_fewer_router_in_flight(
    make_worker, make_router, wait_until
):
    prefill = await make_worker("prefill")
    busy, idle = await make_worker("decode"), await make_worker("decode")
    busy.gate = idle.gate = asyncio.Semaphore(0)  # streams stall after one chunk
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(busy.url, idle.url), policy="power_of_two"
    )
    first = asyncio.create_task(post(router, {**CHAT, "stream": True}, rid="p2c-1"))
    await wait_until(lambda: len(busy.requests) + len(idle.requests) == 1)
    loaded, other = (busy, idle) if busy.requests else (idle, busy)
    second = asyncio.create_task(post(router, {**CHAT, "stream": True}, rid="p2c-2"))
    await wait_until(lambda: len(other.requests) == 1, what="second request on the idle decode")
    assert len(loaded.requests) == 1
    first.cancel()
    second.cancel()


async def test_cache_aware_sends_a_shared_prefix_to_the_same_prefill_and_decode(
    make_worker, make_router
):
    prefills = [await make_worker("prefill") for _ in range(3)]
    decodes = [await make_worker("decode") for _ in range(2)]
    router = await make_router(
        prefill_urls=tuple(w.url for w in prefills),
        decode_urls=tuple(w.url for w in decodes),
        policy="cache_aware",
    )
    system = {"role": "system", "content": "You are a careful assistant. " * 30}
    for i in range(6):
        body = {**CHAT, "messages": [system, {"role": "user", "content": f"question {i}"}]}
        assert (await post(router, body))[0] == 200
    assert sorted(len(w.requests) for w in prefills) == [0, 0, 6]
    assert sorted(len(w.requests) for w in decodes) == [0, 6]
    other = {**CHAT, "messages": [{"role": "user", "content": "unrelated " * 80}]}
    assert (await post(router, other))[0] == 200
    assert sorted(len(w.requests) for w in prefills) == [0, 1, 6]  # the least loaded


async def test_prompt_scoring_goes_to_one_decode_that_prefills_it(make_worker, make_router):
    # echo+logprobs (lm-eval's loglikelihood) needs the prompt's logits: no PD leg pair.
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    scoring = {
        "model": "fake-model",
        "prompt": [1, 2, 3],
        "echo": True,
        "logprobs": 1,
        "max_tokens": 1,
    }
    status, raw = await post(router, {**scoring, "stream": False}, path="/v1/completions")
    assert status == 200, raw
    assert prefill.requests == []
    assert [("kv_transfer_params" in r.body) for r in decode.requests] == [False]
    assert router.stats.num_scoring_on_decode == 1
    status, _ = await post(router, {**CHAT, "stream": False})  # the rest still goes PD
    assert status == 200 and len(prefill.requests) == 1
    assert router.stats.num_decode_fallbacks == 0


async def test_priority_reaches_both_legs_of_every_attempt(make_worker, make_router):
    """The router has no queue of its own (its admission answers at once): the workers order
    their queues by the client's ``priority``, which every leg carries as sent."""
    bad, good = await make_worker("prefill"), await make_worker("prefill")
    decode = await make_worker("decode")
    bad.fail_status = 503
    router = await make_router(
        prefill_urls=(bad.url, good.url), decode_urls=(decode.url,), max_attempts=3,
        policy="round_robin",
    )  # fmt: skip
    status, _ = await post(router, {**CHAT, "stream": True, "priority": -7}, rid="pr-1")
    assert status == 200
    legs = bad.requests + good.requests + decode.requests
    assert len(legs) == 4 and all(r.body["priority"] == -7 for r in legs)
