"""The router's HTTP surface: OpenAI clients, health, metrics, admin, auth, limits."""

from __future__ import annotations

import asyncio
import io

import aiohttp
import openai
import orjson
import pytest

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def call(method: str, url: str, **kwargs) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.request(method, url, **kwargs) as resp:
        return resp.status, await resp.read()


@pytest.fixture
async def pd(make_worker, make_router):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    return router, prefill, decode


def client_for(router, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=router.url + "/v1", api_key=api_key, max_retries=0, timeout=10
    )


async def test_openai_chat_stream_is_passed_through_chunk_by_chunk(pd):
    router, _, decode = pd
    decode.gate = asyncio.Semaphore(0)  # chunk k+1 is only produced after chunk k arrived
    client = client_for(router)
    texts = []
    async with asyncio.timeout(10):
        stream = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for chunk in stream:
            if chunk.choices[0].delta.content:
                texts.append(chunk.choices[0].delta.content)
                decode.gate.release()  # would deadlock if the router buffered the stream
            last = chunk
    assert texts == [f"t{i} " for i in range(decode.num_chunks)]
    assert last.choices[0].finish_reason == "length"
    await client.close()


async def test_openai_completions_stream_and_non_stream(pd):
    router, prefill, decode = pd
    client = client_for(router)
    stream = await client.completions.create(model="fake-model", prompt="hi", stream=True)
    texts = [c.choices[0].text async for c in stream]
    assert "".join(texts) == "t0 t1 t2 t3 "
    result = await client.completions.create(model="fake-model", prompt="hi", max_tokens=4)
    assert result.choices[0].text == "t0 t1 t2 t3 " and result.usage.completion_tokens == 4
    chat = await client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}]
    )
    assert chat.choices[0].message.content == "t0 t1 t2 t3 "
    assert [r.path for r in prefill.requests] == [r.path for r in decode.requests]
    await client.close()


async def test_health_and_readiness(make_worker, make_router):
    prefill = await make_worker("prefill")
    router = await make_router(prefill_urls=(prefill.url,), is_ready_required=False)
    assert (await call("GET", router.url + "/health"))[0] == 200
    status, body = await call("GET", router.url + "/health/ready")
    assert status == 503 and orjson.loads(body)["available"]["prefill"] == 1
    decode = await make_worker("decode")
    status, _ = await call(
        "POST", router.url + "/workers", json={"url": decode.url, "role": "decode"}
    )
    assert status == 201
    assert (await call("GET", router.url + "/health/ready"))[0] == 200


async def test_readiness_counts_the_decode_fallback_and_health_pd_the_pd_path(
    make_worker, make_router
):
    decode = await make_worker("decode")
    serving = await make_router(decode_urls=(decode.url,), is_ready_required=False)
    status, body = await call("GET", serving.url + "/health/ready")
    assert status == 200  # a decode prefills requests itself: the router serves
    assert orjson.loads(body) | {"available": None} == {
        "ready": True, "mode": "serving", "pd_path": False, "serving_path": True,
        "draining": False, "available": None,
    }  # fmt: skip
    status, body = await call("GET", serving.url + "/health/pd")
    assert status == 503 and orjson.loads(body)["mode"] == "pd"
    pd_mode = await make_router(decode_urls=(decode.url,), is_ready_required=False, readiness="pd")
    assert (await call("GET", pd_mode.url + "/health/ready"))[0] == 503
    no_fallback = await make_router(
        decode_urls=(decode.url,), is_ready_required=False, enforce_disagg=True
    )
    assert (await call("GET", no_fallback.url + "/health/ready"))[0] == 503
    prefill = await make_worker("prefill")
    for router in (serving, pd_mode):
        await call("POST", router.url + "/workers", json={"url": prefill.url, "role": "prefill"})
        assert (await call("GET", router.url + "/health/ready"))[0] == 200
        assert (await call("GET", router.url + "/health/pd"))[0] == 200


async def test_metrics_report_requests_retries_in_flight_and_latency(make_worker, make_router):
    bad, good = await make_worker("prefill"), await make_worker("prefill")
    decode = await make_worker("decode")
    bad.fail_status = 500
    router = await make_router(
        prefill_urls=(bad.url, good.url), decode_urls=(decode.url,), breaker_failures=1
    )
    assert (await call("POST", router.url + "/v1/chat/completions", json=CHAT))[0] == 200
    status, body = await call("GET", router.url + "/metrics")
    text = body.decode()
    assert status == 200
    assert 'pdserve_router_requests_total{status="200"} 1.0' in text
    assert "pdserve_router_retries_total 1.0" in text
    assert f'pdserve_router_breaker_opens_total{{worker="{bad.url}"}} 1.0' in text
    assert f'pdserve_router_worker_in_flight{{role="decode",worker="{decode.url}"}} 0.0' in text
    assert "pdserve_router_request_latency_seconds_count 1.0" in text


async def test_runtime_add_list_remove_workers(pd, make_worker):
    router, _, d1 = pd
    d2 = await make_worker("decode")
    status, body = await call(
        "POST", router.url + "/workers", json={"url": d2.url, "role": "decode"}
    )
    added = orjson.loads(body)
    assert status == 201 and added["state"] == "healthy" and added["incarnation"] == "inc-1"
    status, body = await call("GET", router.url + "/workers")
    listed = {w["url"]: w for w in orjson.loads(body)["data"]}
    assert set(listed) == {router.workers.all()[0].url, d1.url, d2.url}
    assert listed[d2.url]["breaker"] == "closed" and listed[d2.url]["in_flight"] == 0
    for _ in range(4):
        await call("POST", router.url + "/v1/chat/completions", json=CHAT)
    assert len(d1.requests) == len(d2.requests) == 2
    status, _ = await call("DELETE", router.url + "/workers", params={"url": d2.url})
    assert status == 200
    for _ in range(2):
        await call("POST", router.url + "/v1/chat/completions", json=CHAT)
    assert len(d2.requests) == 2 and len(d1.requests) == 4


async def test_admin_rejects_bad_input(pd):
    router, _, decode = pd
    url = router.url + "/workers"
    assert (await call("POST", url, json={"url": decode.url, "role": "decode"}))[0] == 409
    assert (await call("POST", url, json={"url": "http://127.0.0.1:1", "role": "boss"}))[0] == 400
    assert (await call("POST", url, data=b"{nope"))[0] == 400
    assert (await call("DELETE", url, params={"url": "http://127.0.0.1:1"}))[0] == 404
    assert (await call("DELETE", url))[0] == 400


async def test_bad_requests_get_openai_errors(pd):
    router, prefill, decode = pd
    url = router.url + "/v1/chat/completions"
    cases = [
        ({"data": b"{not json"}, 400),
        ({"data": b"\xff\xfe"}, 400),
        ({"json": [1, 2]}, 400),
        ({"json": CHAT, "headers": {"X-Request-Id": "bad id!"}}, 400),
        ({"data": io.BytesIO(b"x" * (router.config.max_body_bytes + 1))}, 413),
    ]
    for kwargs, expected in cases:
        status, body = await call("POST", url, **kwargs)
        assert status == expected, (kwargs.keys(), body)
        assert set(orjson.loads(body)["error"]) == {"message", "type", "param", "code"}
    assert (await call("GET", url))[0] == 405
    assert prefill.requests == decode.requests == []


async def test_request_id_in_flight_twice_is_rejected(pd, wait_until):
    router, prefill, _ = pd
    prefill.is_hanging = True
    url = router.url + "/v1/chat/completions"
    headers = {"X-Request-Id": "dup-1"}
    first = asyncio.create_task(call("POST", url, json=CHAT, headers=headers))
    await wait_until(lambda: prefill.requests)
    assert (await call("POST", url, json=CHAT, headers=headers))[0] == 409
    first.cancel()


async def test_api_key_required_except_health_and_worker_key_forwarded(make_worker, make_router):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    router = await make_router(
        prefill_urls=(prefill.url,),
        decode_urls=(decode.url,),
        api_key="sekret",
        admin_api_key="admin-sekret",
        worker_api_key="worker-key",
    )
    url = router.url + "/v1/chat/completions"
    assert (await call("POST", url, json=CHAT))[0] == 401
    bad = {"Authorization": "Bearer nope"}
    assert (await call("POST", url, json=CHAT, headers=bad))[0] == 401
    assert (await call("GET", router.url + "/workers"))[0] == 401
    assert (await call("GET", router.url + "/health"))[0] == 200
    assert (await call("GET", router.url + "/metrics"))[0] == 401  # the admin key's
    admin = {"Authorization": "Bearer admin-sekret"}
    assert (await call("GET", router.url + "/metrics", headers=admin))[0] == 200
    client = client_for(router, api_key="sekret")
    chat = await client.chat.completions.create(model="fake-model", messages=CHAT["messages"])
    assert chat.choices[0].message.content
    await client.close()
    assert decode.requests[0].authorization == "Bearer worker-key"
    assert prefill.requests[0].authorization == "Bearer worker-key"


async def test_models_come_from_a_healthy_worker(pd):
    router, _, _ = pd
    status, body = await call("GET", router.url + "/v1/models")
    assert status == 200 and orjson.loads(body)["data"][0]["id"] == "fake-model"


async def test_a_new_router_finds_running_workers(pd, make_router):
    old, prefill, decode = pd
    await old.stop()
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    assert (await call("POST", router.url + "/v1/chat/completions", json=CHAT))[0] == 200


async def test_debug_requests_lists_live_requests_and_is_empty_when_idle(pd, wait_until):
    router, prefill, _ = pd
    prefill.is_hanging = True
    url = router.url + "/v1/chat/completions"
    task = asyncio.create_task(call("POST", url, json=CHAT, headers={"X-Request-Id": "dbg-1"}))
    await wait_until(lambda: prefill.requests)
    status, body = await call("GET", router.url + "/debug/requests")
    [live] = orjson.loads(body)["data"]
    assert status == 200 and live["request_id"] == "dbg-1" and len(live["room_id"]) == 32
    assert [leg["role"] for leg in live["legs"]] == ["prefill", "decode"]
    task.cancel()
    await wait_until(lambda: router.stats.requests_by_status["499"] == 1)
    assert orjson.loads((await call("GET", router.url + "/debug/requests"))[1])["data"] == []


async def test_router_stop_aborts_in_flight_legs(pd, wait_until):
    router, prefill, decode = pd
    prefill.is_hanging = True
    url = router.url + "/v1/chat/completions"
    task = asyncio.create_task(call("POST", url, json=CHAT, headers={"X-Request-Id": "stop-1"}))
    await wait_until(lambda: prefill.requests and decode.requests)
    await router.stop()
    assert "stop-1" in prefill.aborts and "stop-1" in decode.aborts
    with pytest.raises(aiohttp.ClientError):
        await asyncio.wait_for(task, 5)
