"""Worker registry (router/workers.py) and health checks (router/health.py): validation, taking
workers out and back, restarts."""

from __future__ import annotations

import aiohttp
import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.health import ProbeResult, apply_probe
from pdserve.router.workers import (
    HEALTHY,
    UNHEALTHY,
    UNKNOWN,
    ServerInfoMsg,
    WorkerManager,
)

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
INFO = {
    "role": "prefill",
    "model": "m",
    "engine_id": "e1",
    "incarnation": "i1",
    "bootstrap_port": 8998,
    "max_model_len": 2048,
}


async def post_chat(router) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(router.url + "/v1/chat/completions", json=CHAT) as resp,
    ):
        await resp.read()
        return resp.status


def test_server_info_is_validated():
    assert ServerInfoMsg.from_json(INFO).bootstrap_port == 8998
    assert ServerInfoMsg.from_json({**INFO, "incarnation": 7}).incarnation == "7"
    bad = [
        [],
        {**INFO, "role": "router"},
        {**INFO, "bootstrap_port": None},  # a prefill must say where its bootstrap server is
        {**INFO, "bootstrap_port": True},  # bool is not an int
        {**INFO, "bootstrap_port": 70000},
        {**INFO, "max_model_len": "2048"},
        {**INFO, "incarnation": ""},
    ]
    for raw in bad:
        with pytest.raises(ValueError):
            ServerInfoMsg.from_json(raw)
    decode = ServerInfoMsg.from_json({**INFO, "role": "decode", "bootstrap_port": None})
    assert decode.bootstrap_port is None


def test_manager_add_normalizes_and_rejects_duplicates_and_bad_input():
    manager = WorkerManager(RouterConfig())
    worker = manager.add("http://127.0.0.1:9001/", "decode")
    assert worker.url == "http://127.0.0.1:9001" and worker.state == UNKNOWN
    with pytest.raises(ValueError, match="already registered"):
        manager.add("http://127.0.0.1:9001", "decode")
    for url, role in [
        ("http://127.0.0.1:9002", "router"),
        ("127.0.0.1:9002", "decode"),
        ("http://127.0.0.1", "decode"),
        ("http://127.0.0.1:9002/v1", "decode"),
    ]:
        with pytest.raises(ValueError):
            manager.add(url, role)
    assert manager.remove("http://127.0.0.1:9001/") is worker
    assert manager.remove("http://127.0.0.1:9001") is None
    assert manager.all() == []


def test_availability_needs_health_and_a_closed_breaker():
    manager = WorkerManager(RouterConfig(breaker_failures=1))
    prefill = manager.add("http://127.0.0.1:9001", "prefill")
    decode = manager.add("http://127.0.0.1:9002", "decode")
    assert not manager.has_complete_path()  # unknown is not healthy
    apply_probe(prefill, ProbeResult(True, ServerInfoMsg.from_json(INFO), None), 1.0)
    decode_info = ServerInfoMsg.from_json({**INFO, "role": "decode", "bootstrap_port": None})
    apply_probe(decode, ProbeResult(True, decode_info, None), 1.0)
    assert manager.has_complete_path()
    decode.breaker.record_failure("boom")
    assert manager.available("decode") == [] and not manager.has_complete_path()
    colocated = manager.add("http://127.0.0.1:9003", "colocated")
    colo_info = ServerInfoMsg.from_json({**INFO, "role": "colocated", "bootstrap_port": None})
    apply_probe(colocated, ProbeResult(True, colo_info, None), 1.0)
    assert manager.has_complete_path()


def test_probe_with_new_incarnation_resets_breaker_and_takes_new_bootstrap_port():
    manager = WorkerManager(RouterConfig(breaker_failures=1))
    worker = manager.add("http://127.0.0.1:9001", "prefill")
    apply_probe(worker, ProbeResult(True, ServerInfoMsg.from_json(INFO), None), 1.0)
    worker.breaker.record_failure("boom")
    assert not worker.is_available()
    restarted = ServerInfoMsg.from_json({**INFO, "incarnation": "i2", "bootstrap_port": 9999})
    apply_probe(worker, ProbeResult(True, restarted, None), 2.0)
    assert worker.is_available() and worker.info.bootstrap_port == 9999
    assert worker.to_json()["incarnation"] == "i2"


def test_role_mismatch_keeps_worker_out():
    manager = WorkerManager(RouterConfig())
    worker = manager.add("http://127.0.0.1:9001", "decode")
    apply_probe(worker, ProbeResult(True, ServerInfoMsg.from_json(INFO), None), 1.0)
    assert worker.state == UNHEALTHY and "role mismatch" in worker.last_error


async def test_unhealthy_worker_is_taken_out_and_put_back(make_worker, make_router, wait_until):
    prefill = await make_worker("prefill")
    d1, d2 = await make_worker("decode"), await make_worker("decode")
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(d1.url, d2.url), health_interval_s=0.05
    )
    d1.is_ready = False
    w1 = router.workers.get(d1.url)
    await wait_until(lambda: w1.state == UNHEALTHY, what="d1 taken out")
    for _ in range(4):
        assert await post_chat(router) == 200
    assert d1.requests == [] and len(d2.requests) == 4
    d1.is_ready = True
    await wait_until(lambda: w1.state == HEALTHY, what="d1 put back")
    for _ in range(4):
        assert await post_chat(router) == 200
    assert len(d1.requests) == 2


async def test_worker_restarted_on_same_url_with_new_incarnation_is_used_again(
    make_worker, make_router, wait_until
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    router = await make_router(
        prefill_urls=(prefill.url,),
        decode_urls=(decode.url,),
        health_interval_s=0.05,
        enforce_disagg=True,  # no decode-prefills-itself fallback while the prefill is down
    )
    assert await post_chat(router) == 200
    worker = router.workers.get(prefill.url)
    await prefill.stop()
    await wait_until(lambda: worker.state == UNHEALTHY, what="dead prefill taken out")
    assert await post_chat(router) == 503
    await prefill.restart("inc-2", bootstrap_port=18999)
    await wait_until(lambda: worker.is_available(), what="restarted prefill back")
    assert worker.info.incarnation == "inc-2"
    assert await post_chat(router) == 200
    assert decode.requests[-1].body["kv_transfer_params"]["bootstrap_port"] == 18999


async def test_worker_started_after_the_router_is_picked_up(make_worker, make_router, wait_until):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    port = prefill.port
    await prefill.stop()  # its URL is known, but nothing listens there yet
    router = await make_router(
        prefill_urls=(prefill.url,),
        decode_urls=(decode.url,),
        health_interval_s=0.05,
        is_ready_required=False,
        enforce_disagg=True,  # without a prefill, nothing may serve
    )
    assert not router.workers.has_complete_path()
    assert await post_chat(router) == 503
    await prefill.start(port)
    await wait_until(router.workers.has_complete_path, what="late prefill picked up")
    assert await post_chat(router) == 200
