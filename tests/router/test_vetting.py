"""A registered or added worker URL is vetted before it joins (router/vetting.py): http(s), a host
in --worker-allow, and pdserve's identity with the fleet's model. Each refusal is a 4xx naming
why, and no request (not even a probe, where the host is refused) reaches the refused URL."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from pdserve.router.worker_allow import WorkerAllowList
from tests.router.helpers import CHAT, post
from tests.router.test_registry_api import registration


async def send(router: Any, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, router.url + path, json=body) as resp,
    ):
        return resp.status, await resp.json()


@pytest.fixture
def probes(monkeypatch) -> list[str]:
    """Every URL the router's health checker probes (records, then probes for real)."""
    from pdserve.router.health import HealthChecker

    seen: list[str] = []
    real = HealthChecker.probe

    async def recording(self: HealthChecker, url: str) -> Any:
        seen.append(url)
        return await real(self, url)

    monkeypatch.setattr(HealthChecker, "probe", recording)
    return seen


def fake_registration(url: str, **change: Any) -> dict[str, Any]:
    body = {"url": url, "role": "decode", "model": "fake-model", "dtype": "bfloat16",
            "kv_layout": "layout-1", "engine_id": "decode-x", "incarnation": "i",
            "ttl_s": 30.0}  # fmt: skip
    return {**body, **change}


@pytest.mark.parametrize("path", ["/workers/register", "/workers"])
async def test_the_metadata_address_is_refused_before_any_connection(path, make_router, probes):
    router = await make_router(is_ready_required=False)
    url = "http://169.254.169.254:80"
    body = fake_registration(url) if path.endswith("register") else {"url": url, "role": "decode"}
    status, reply = await send(router, "POST", path, body)
    assert status == 403, reply
    error = reply["error"]
    assert error["code"] == "worker_not_allowed" and error["param"] == "url"
    assert "169.254.169.254" in error["message"] and "--worker-allow" in error["message"]
    assert probes == [] and router.workers.all() == []


@pytest.mark.parametrize("path", ["/workers/register", "/workers"])
async def test_a_file_url_is_refused_as_not_http(path, make_router, probes):
    router = await make_router(is_ready_required=False)
    url = "file:///etc/passwd"
    body = fake_registration(url) if path.endswith("register") else {"url": url, "role": "decode"}
    status, reply = await send(router, "POST", path, body)
    assert status == 400 and reply["error"]["param"] == "url"
    assert "file:///etc/passwd" in reply["error"]["message"]
    assert "http" in reply["error"]["message"]
    assert probes == [] and router.workers.all() == []


async def test_a_host_outside_worker_allow_is_refused_and_never_probed(
    make_worker, make_router, probes
):
    decode = await make_worker("decode")
    router = await make_router(is_ready_required=False, worker_allow=("10.0.0.0/8",))
    status, reply = await send(router, "POST", "/workers/register", registration(decode))
    assert status == 403 and "127.0.0.1" in reply["error"]["message"]
    assert "10.0.0.0/8" in reply["error"]["message"]
    status, _ = await send(router, "POST", "/workers", {"url": decode.url, "role": "decode"})
    assert status == 403
    assert probes == [] and decode.num_info_checks == decode.num_health_checks == 0
    assert router.workers.all() == []


async def test_a_prefill_whose_bootstrap_host_is_outside_worker_allow_is_refused(
    make_worker, make_router
):
    prefill = await make_worker("prefill")
    router = await make_router(is_ready_required=False)
    body = registration(prefill, bootstrap_host="169.254.169.254")
    status, reply = await send(router, "POST", "/workers/register", body)
    assert status == 403 and reply["error"]["param"] == "bootstrap_host"
    assert router.workers.all() == []


async def test_a_worker_serving_another_model_is_refused_and_gets_no_request(
    make_worker, make_router
):
    good, other = await make_worker("decode"), await make_worker("decode")
    other.model = "another-model"
    router = await make_router(is_ready_required=False)
    assert (await send(router, "POST", "/workers/register", registration(good)))[0] == 201
    status, reply = await send(router, "POST", "/workers/register", registration(other))
    assert status == 409, reply
    error = reply["error"]
    assert error["code"] == "worker_identity_mismatch"
    assert "'another-model'" in error["message"] and "'fake-model'" in error["message"]
    status, _ = await send(router, "POST", "/workers", {"url": other.url, "role": "decode"})
    assert status == 409
    for _ in range(3):
        assert (await post(router, CHAT))[0] == 200
    assert len(good.requests) == 3 and other.requests == []
    assert router.workers.get(other.url) is None


async def test_the_served_model_flag_refuses_even_the_first_worker(make_worker, make_router):
    decode = await make_worker("decode")
    router = await make_router(is_ready_required=False, served_model_name="the-real-model")
    status, reply = await send(router, "POST", "/workers", {"url": decode.url, "role": "decode"})
    assert status == 409 and "'the-real-model'" in reply["error"]["message"]
    decode.model = "the-real-model"
    body = registration(decode)
    assert (await send(router, "POST", "/workers/register", body))[0] == 201


async def test_a_registration_must_match_what_the_worker_serves(make_worker, make_router):
    decode = await make_worker("decode")
    router = await make_router(is_ready_required=False)
    body = registration(decode, model="claimed-model")
    status, reply = await send(router, "POST", "/workers/register", body)
    assert status == 409 and "'claimed-model'" in reply["error"]["message"]
    body = registration(decode, role="prefill", bootstrap_port=1)
    status, reply = await send(router, "POST", "/workers/register", body)
    assert status == 409 and "serves as decode, not prefill" in reply["error"]["message"]


async def test_other_weights_than_the_fleets_are_refused(make_worker, make_router):
    first, second = await make_worker("decode"), await make_worker("decode")
    first.weights, second.weights = "w-1", "w-2"
    router = await make_router(is_ready_required=False)
    body = registration(first, weights="w-1")
    assert (await send(router, "POST", "/workers/register", body))[0] == 201
    status, reply = await send(
        router, "POST", "/workers/register", registration(second, weights="w-2")
    )
    assert status == 409 and "'w-1'" in reply["error"]["message"]


async def test_a_url_that_answers_no_identity_is_refused(make_router, probes):
    router = await make_router(is_ready_required=False)
    body = {"url": "http://127.0.0.1:9", "role": "decode"}  # the discard port: nothing listens
    status, reply = await send(router, "POST", "/workers", body)
    assert status == 422 and reply["error"]["code"] == "worker_unverified"
    assert "/server_info" in reply["error"]["message"]
    assert probes == ["http://127.0.0.1:9"] and router.workers.all() == []


async def test_allow_list_entries_are_cidrs_or_names_and_names_resolve() -> None:
    allow = WorkerAllowList.parse(["10.0.0.0/8", "worker-0.pods", ".svc.local", "127.0.0.1", "::1"])
    assert await allow.refusal("10.1.2.3", 1.0) is None
    assert await allow.refusal("worker-0.pods", 1.0) is None
    assert await allow.refusal("a.b.svc.local", 1.0) is None
    assert await allow.refusal("localhost", 1.0) is None  # resolves to loopback only
    assert "not in --worker-allow" in (await allow.refusal("192.168.1.1", 1.0) or "")
    assert "not in --worker-allow" in (await allow.refusal("::ffff:169.254.169.254", 1.0) or "")
    with pytest.raises(ValueError, match="neither a CIDR nor a host name"):
        WorkerAllowList.parse(["http://x"])
    default = WorkerAllowList.default()
    assert await default.refusal("127.0.0.1", 1.0) is None
    assert await default.refusal("169.254.169.254", 1.0) is not None
