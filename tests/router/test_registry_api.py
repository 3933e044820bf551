"""Self-registration at the router: leases, renewal, expiry, deregistration, compatibility."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.router.helpers import CHAT, post


def registration(worker: Any, *, ttl_s: float = 30.0, **change: Any) -> dict[str, Any]:
    body = {
        "url": worker.url,
        "role": worker.role,
        "model": worker.model,
        "dtype": worker.dtype,
        "kv_layout": worker.kv_layout,
        "engine_id": f"{worker.role}-{worker.port}",
        "incarnation": worker.incarnation,
        "ttl_s": ttl_s,
        "bootstrap_host": "127.0.0.1" if worker.role == "prefill" else None,
        "bootstrap_port": worker.bootstrap_port,
    }
    return {**body, **change}


async def call(router: Any, path: str, body: Any) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(router.url + path, json=body) as resp,
    ):
        return resp.status, await resp.json()


async def listed(router: Any) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(router.url + "/workers") as resp:
        return {w["url"]: w for w in (await resp.json())["data"]}


async def test_registered_workers_serve_and_renewals_keep_them(make_worker, make_router):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    router = await make_router(is_ready_required=False)
    assert not router.workers.has_complete_path()
    for worker in (prefill, decode):
        status, body = await call(router, "/workers/register", registration(worker))
        assert status == 201, body
        assert body["state"] == "healthy" and body["registered"] and body["compatible"]
    status, raw = await post(router, CHAT)
    assert status == 200, raw
    # The decode leg was told the registered bootstrap address of the prefill.
    kv = decode.requests[-1].body["kv_transfer_params"]
    assert (kv["bootstrap_host"], kv["bootstrap_port"]) == ("127.0.0.1", prefill.bootstrap_port)
    status, body = await call(router, "/workers/register", registration(decode))
    assert status == 200 and body["lease_s"] == 30.0  # a renewal, not a new worker
    assert len(router.workers.all()) == 2


async def test_an_expired_lease_is_forgotten_and_a_renewal_brings_it_back(
    make_worker, make_router, wait_until
):
    decode = await make_worker("decode")
    router = await make_router(is_ready_required=False, health_interval_s=0.05)
    assert (await call(router, "/workers/register", registration(decode, ttl_s=0.3)))[0] == 201
    await wait_until(lambda: router.workers.get(decode.url) is None, what="lease expiry")
    assert decode.url not in await listed(router)
    status, body = await call(router, "/workers/register", registration(decode, ttl_s=30))
    assert status == 201 and body["state"] == "healthy"


async def test_static_workers_never_expire_and_ignore_deregistration(make_worker, make_router):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    assert (await call(router, "/workers/register", registration(decode, ttl_s=0.2)))[0] == 200
    router.workers.expire()
    bye = {"url": decode.url, "incarnation": decode.incarnation}
    assert (await call(router, "/workers/deregister", bye))[1]["removed"] is False
    assert router.workers.get(decode.url) is not None


async def test_deregistration_removes_only_the_registered_incarnation(make_worker, make_router):
    decode = await make_worker("decode")
    router = await make_router(is_ready_required=False)
    await call(router, "/workers/register", registration(decode))
    stale = {"url": decode.url, "incarnation": "an-earlier-life"}
    assert (await call(router, "/workers/deregister", stale))[1]["removed"] is False
    bye = {"url": decode.url, "incarnation": decode.incarnation}
    assert (await call(router, "/workers/deregister", bye)) == (
        200,
        {"url": decode.url, "removed": True},
    )
    assert router.workers.get(decode.url) is None


async def test_bad_registrations_get_a_4xx_naming_the_field(make_worker, make_router):
    decode = await make_worker("decode")
    router = await make_router(is_ready_required=False)
    status, body = await call(router, "/workers/register", registration(decode, ttl_s=-1))
    assert status == 400 and body["error"]["param"] == "ttl_s"
    status, body = await call(router, "/workers/register", registration(decode, url="nope"))
    assert status == 400 and body["error"]["param"] == "url"
    assert (await call(router, "/workers/register", [1]))[0] == 400
    assert (await call(router, "/workers/register", registration(decode)))[0] == 201
    status, body = await call(router, "/workers/register", registration(decode, role="colocated"))
    assert status == 409 and "registered as decode" in body["error"]["message"]
    assert (await call(router, "/workers/deregister", {"url": decode.url}))[0] == 400


async def test_a_mismatched_decode_is_listed_with_the_reason_and_never_paired(
    make_worker, make_router
):
    prefill, good, odd = [await make_worker(r) for r in ("prefill", "decode", "decode")]
    odd.dtype = "float16"
    router = await make_router(is_ready_required=False)
    await call(router, "/workers/register", registration(prefill))
    status, body = await call(router, "/workers/register", registration(odd))
    assert status == 201
    await call(router, "/workers/register", registration(good))
    entry = (await listed(router))[odd.url]
    assert entry["compatible"] is False
    assert "dtype 'float16' != 'bfloat16'" in entry["compatibility_error"]
    assert [w.url for w in router.workers.available("decode")] == [good.url]
    for _ in range(4):
        assert (await post(router, CHAT))[0] == 200
    assert not odd.requests and len(good.requests) == 4
    # Only the odd pair left: the router is not ready rather than pairing them.
    router.workers.remove(good.url)
    prefill.dtype = odd.dtype = "bfloat16"
    odd.model = "another-model"
    await router.health.check_all()
    assert not router.workers.has_complete_path()
    assert "model" in (await listed(router))[odd.url]["compatibility_error"]
