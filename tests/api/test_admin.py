from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient

from .conftest import assert_openai_error, completion_body, wait_until
from .engine_double import MODEL, FakeEngine


async def test_health_is_always_200_and_ready_follows_the_engine(
    client: TestClient, engine: FakeEngine
) -> None:
    assert (await client.get("/health")).status == 200
    assert (await client.get("/health/ready")).status == 200
    engine.ready = False
    assert (await client.get("/health")).status == 200
    not_ready = await client.get("/health/ready")
    assert not_ready.status == 503
    assert assert_openai_error(await not_ready.json())["code"] == "not_ready"


async def test_server_info_describes_the_engine(client: TestClient, engine: FakeEngine) -> None:
    info = await (await client.get("/server_info")).json()
    assert info == {
        "role": "colocated",
        "model": MODEL,
        "served_model_name": MODEL,
        "engine_id": "engine-1",
        "incarnation": "inc-1",
        "bootstrap_port": None,
        "max_model_len": engine.info.max_model_len,
        "dtype": "",  # the fake engine publishes no KV layout (a Server fills both in)
        "kv_layout": "",
        "weights": "",
        "extra": {},
        "load": {**engine.load(), "draining": False},
    }


async def test_metrics_count_requests_by_endpoint_and_status(client: TestClient) -> None:
    await client.post("/v1/completions", json=completion_body("a", max_tokens=1))
    await client.post("/v1/completions", json=completion_body("", max_tokens=1))
    await client.get("/no/such/path")
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    text = await resp.text()
    assert 'pdserve_http_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert 'pdserve_http_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
    assert 'pdserve_http_requests_total{endpoint="unmatched",status="404"} 1.0' in text
    assert 'pdserve_http_request_errors_total{type="invalid_request_error"} 2.0' in text


async def test_debug_listings_show_live_work_and_are_empty_when_idle(
    client: TestClient, engine: FakeEngine
) -> None:
    assert await (await client.get("/debug/requests")).json() == {"data": []}
    assert await (await client.get("/debug/rooms")).json() == {"data": []}
    engine.hang_after = 0
    kv = {"room_id": "room-5", "bootstrap_host": "127.0.0.1", "bootstrap_port": 9000}
    task = asyncio.create_task(
        client.post(
            "/v1/completions",
            json=completion_body("a", kv_transfer_params=kv),
            headers={"X-Request-Id": "dbg"},
        )
    )
    await wait_until(lambda: "dbg" in engine.live)
    requests = (await (await client.get("/debug/requests")).json())["data"]
    rooms = (await (await client.get("/debug/rooms")).json())["data"]
    assert [r["request_id"] for r in requests] == ["dbg"]
    assert rooms == [{"room_id": "room-5", "request_id": "dbg"}]
    abort = await client.post("/abort/dbg")
    assert await abort.json() == {"aborted": True}
    async with asyncio.timeout(5):
        resp = await task
    assert (await resp.json())["choices"][0]["finish_reason"] == "abort"
    assert await (await client.get("/debug/requests")).json() == {"data": []}


async def test_abort_reaches_every_choice_of_a_request(
    client: TestClient, engine: FakeEngine
) -> None:
    engine.hang_after = 1
    task = asyncio.create_task(
        client.post(
            "/v1/completions", json=completion_body("a", n=3), headers={"X-Request-Id": "multi"}
        )
    )
    await wait_until(lambda: len(engine.live) == 3)
    assert await (await client.post("/abort/multi")).json() == {"aborted": True}
    assert engine.aborted_ids() == {"multi-0", "multi-1", "multi-2"}
    async with asyncio.timeout(5):
        body = await (await task).json()
    assert [c["finish_reason"] for c in body["choices"]] == ["abort"] * 3
    assert await (await client.post("/abort/multi")).json() == {"aborted": False}


async def test_abort_validates_the_id(client: TestClient) -> None:
    resp = await client.post("/abort/" + "x" * 200)
    assert resp.status == 400
    assert_openai_error(await resp.json(), "request_id")
    assert (await client.get("/abort/some-id")).status == 405


async def test_drain_turns_readiness_and_new_requests_away_with_a_retryable_503(
    client: TestClient, engine: FakeEngine
) -> None:
    reply = await client.post("/drain")
    assert reply.status == 202 and (await reply.json())["started"] is True
    assert (await (await client.post("/drain")).json())["started"] is False  # idempotent
    ready = await client.get("/health/ready")
    assert ready.status == 503
    assert assert_openai_error(await ready.json())["code"] == "draining"
    turned_away = await client.post("/v1/completions", json=completion_body("a", max_tokens=1))
    assert turned_away.status == 503
    assert turned_away.headers["Retry-After"].isdigit()
    error = assert_openai_error(await turned_away.json())
    assert error["type"] == "draining" and error["code"] == "draining"
    assert engine.requests == []  # the engine never saw it
    info = await (await client.get("/server_info")).json()
    assert info["load"]["draining"] is True
    assert (await client.get("/health")).status == 200  # alive: liveness must not kill it


async def test_a_request_in_flight_when_the_drain_begins_finishes(
    client: TestClient, engine: FakeEngine
) -> None:
    engine.hang_after = 1
    pending = asyncio.ensure_future(
        client.post("/v1/completions", json=completion_body("abc", max_tokens=3))
    )
    await wait_until(lambda: bool(engine.live))
    assert (await client.post("/drain")).status == 202
    engine.resume()
    reply = await pending
    assert reply.status == 200
    assert (await reply.json())["choices"][0]["finish_reason"] == "length"
