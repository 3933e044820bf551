"""Backpressure on both roles (router/admission.py): a prefill flood is answered 429 with
Retry-After, by the backlog the prefills report and by the prompt tokens this router sent them
and has not seen prefilled; text prompts are counted by a worker's /tokenize when it matters."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson

from .helpers import post

FREE = {"free_pages": 10_000, "page_size": 16, "num_requests": 0, "waiting": 0}
IDS = {"model": "fake-model", "prompt": list(range(1000)), "max_tokens": 4, "stream": True}


async def _post_429(router, body) -> tuple[int, str | None, dict]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(router.url + "/v1/completions", json=body) as r,
    ):
        return r.status, r.headers.get("Retry-After"), orjson.loads(await r.read())


async def test_a_prefill_reporting_a_full_backlog_gets_no_more_prompts(make_worker, make_router):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.load = {**FREE, "waiting_prompt_tokens": 2500}
    decode.load = FREE
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(decode.url,), max_prefill_backlog_tokens=3000
    )
    status, retry_after, body = await _post_429(router, IDS)
    assert status == 429 and retry_after is not None and retry_after.isdigit()
    assert body["error"]["code"] == "overloaded"
    assert "2500 prompt tokens queued for prefill" in body["error"]["message"]
    assert prefill.requests == [] and decode.requests == []
    assert (await post(router, {**IDS, "prompt": [1] * 400}, path="/v1/completions"))[0] == 200
    prefill.load = {**FREE, "waiting_prompt_tokens": 0}  # it caught up
    await router.health.check_all()
    assert (await post(router, IDS, path="/v1/completions"))[0] == 200


async def test_a_prefill_flood_is_refused_before_any_probe_shows_it(
    make_worker, make_router, wait_until
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.is_hanging = True  # prefills never end: every prompt sent stays in its backlog
    decode.kv_wait_timeout_s = 60  # ... and their decodes wait, not fail over
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(decode.url,), max_prefill_backlog_tokens=3000,
        health_interval_s=3600,
    )  # fmt: skip
    flood = [asyncio.create_task(_post_429(router, IDS)) for _ in range(3)]
    await wait_until(lambda: len(prefill.requests) == 3, what="3 prompts at the prefill")
    worker = router.workers.get(prefill.url)
    assert worker is not None and worker.prefill_backlog() == 3000
    for _ in range(5):  # the flood goes on: each one refused at once, nothing queued
        status, retry_after, _ = await _post_429(router, IDS)
        assert status == 429 and retry_after is not None
    assert len(prefill.requests) == 3 and router.stats.num_shed == 5
    for rid in prefill.rids():
        await post(router, {}, path=f"/abort/{rid}")
    await asyncio.gather(*flood)
    assert worker.prefill_backlog() == 0 and worker.num_in_flight == 0


async def test_text_prompts_are_counted_by_a_worker_once_prefills_are_in_flight(
    make_worker, make_router, wait_until
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    decode.kv_wait_timeout_s = 60  # the hanging prefill's pairs wait, not fail over
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(decode.url,), max_prefill_backlog_tokens=3000
    )
    text = {"model": "fake-model", "prompt": "word " * 2500, "max_tokens": 4}
    assert (await post(router, text, path="/v1/completions"))[0] == 200
    assert prefill.tokenized == []  # an idle fleet: whatever its size, it is admitted
    prefill.is_hanging = True
    held = [asyncio.create_task(_post_429(router, text))]  # idle still: not counted
    await wait_until(lambda: len(prefill.requests) == 2, what="a prompt at the prefill")
    held.append(asyncio.create_task(_post_429(router, text)))  # busy: counted, 2500 tokens
    await wait_until(lambda: len(prefill.requests) == 3, what="a counted prompt at the prefill")
    worker = router.workers.get(prefill.url)
    assert worker is not None and worker.prefill_backlog() == 2500
    status, retry_after, body = await _post_429(router, {**text, "prompt": "word " * 600})
    assert status == 429 and retry_after is not None
    assert "2500 prompt tokens queued" in body["error"]["message"]
    assert [len(b["prompt"].split()) for b in prefill.tokenized] == [2500, 600]
    for rid in prefill.rids()[1:]:
        await post(router, {}, path=f"/abort/{rid}")
    await asyncio.gather(*held)
    assert worker.prefill_backlog() == 0


async def test_a_worker_that_cannot_count_never_gets_a_text_prompt_refused(
    make_worker, make_router
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.load = {**FREE, "waiting_prompt_tokens": 2900}  # busy: a text must be counted
    prefill.is_tokenize_broken = True
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(decode.url,), max_prefill_backlog_tokens=3000
    )
    text = {"model": "fake-model", "prompt": "word " * 2000, "max_tokens": 4}
    assert (await post(router, text, path="/v1/completions"))[0] == 200  # counted as 0
    assert len(prefill.tokenized) == 1


async def test_token_id_batches_and_responses_bodies_count_against_the_backlog(
    make_worker, make_router
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.load = {**FREE, "waiting_prompt_tokens": 2500}
    decode.load = FREE
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(decode.url,), max_prefill_backlog_tokens=3000
    )
    batch = {**IDS, "prompt": [list(range(300)), list(range(300))]}  # 600 tokens, exactly
    status, retry_after, body = await _post_429(router, batch)
    assert status == 429 and retry_after is not None
    assert "2500 prompt tokens queued" in body["error"]["message"]
    small = {**IDS, "prompt": [list(range(200)), list(range(200))]}  # 400 fit beside 2500
    assert (await post(router, small, path="/v1/completions"))[0] == 200
    response = {"model": "fake-model", "instructions": "be brief", "input": "word " * 600,
                "max_output_tokens": 4}  # fmt: skip
    async with (
        aiohttp.ClientSession() as session,
        session.post(router.url + "/v1/responses", json=response) as r,
    ):
        assert r.status == 429, await r.read()
    assert prefill.tokenized[-1]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "word " * 600},
    ]  # counted by the worker as the chat it stands for: 602 words
    assert len(prefill.requests) == 1  # only the batch that fits reached the prefill
