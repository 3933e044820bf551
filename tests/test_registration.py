"""A worker keeping itself registered with routers (pdserve/registration.py)."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import replace

import pytest
from aiohttp import web

from pdserve.registration import Registration, RegistrationConfig
from pdserve.registration_msg import RegistrationMsg
from pdserve.router import Router
from tests.router.conftest import TEST_CONFIG, FakeWorker, KVBoard, _wait_until

FAST = RegistrationConfig(router_urls=("http://127.0.0.1:1",), interval_s=0.05, ttl_s=1.0)


def msg_for(worker: FakeWorker) -> RegistrationMsg:
    return RegistrationMsg(
        url=worker.url,
        role=worker.role,
        model=worker.model,
        dtype=worker.dtype,
        kv_layout=worker.kv_layout,
        engine_id=f"{worker.role}-{worker.port}",
        incarnation=worker.incarnation,
        ttl_s=1.0,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_router(port: int = 0) -> Router:
    router = Router(replace(TEST_CONFIG, port=port, health_interval_s=0.05))
    await router.start()
    return router


@pytest.fixture
async def decode():
    worker = FakeWorker("decode", KVBoard())
    await worker.start()
    yield worker
    await worker.stop()


def test_config_rejects_a_lease_shorter_than_the_renewal_interval_and_bad_urls():
    with pytest.raises(ValueError, match="--register-ttl"):
        replace(FAST, ttl_s=0.05)
    with pytest.raises(ValueError, match="at least one"):
        replace(FAST, router_urls=())
    with pytest.raises(ValueError, match="more than once"):
        replace(FAST, router_urls=("http://r:1", "http://r:1/"))
    with pytest.raises(ValueError):
        replace(FAST, router_urls=("r:1",))


async def test_two_routers_both_learn_the_worker_and_both_forget_it_on_deregister(decode):
    routers = [await start_router(), await start_router()]
    reg = Registration(replace(FAST, router_urls=tuple(r.url for r in routers)), msg_for(decode))
    try:
        reg.start()
        assert await reg.wait_registered(5.0)
        for router in routers:
            await _wait_until(lambda r=router: r.workers.available("decode") != [], what="healthy")
        await _wait_until(lambda: reg.num_renewals >= 6, what="renewals")
        assert all(r.workers.get(decode.url) is not None for r in routers)  # the lease held
        await reg.deregister()
        assert all(r.workers.get(decode.url) is None for r in routers)
        await reg.deregister()  # idempotent
    finally:
        for router in routers:
            await router.stop()


async def test_a_router_down_at_start_or_restarted_learns_the_worker_from_renewals(decode):
    port = free_port()
    reg = Registration(replace(FAST, router_urls=(f"http://127.0.0.1:{port}",)), msg_for(decode))
    began = time.monotonic()
    reg.start()  # returns at once: nothing waits for a router
    assert not await reg.wait_registered(0.2)
    router = await start_router(port)
    try:
        assert await reg.wait_registered(5.0)  # the backoff is capped by the interval
        await router.stop()
        router = await start_router(port)  # soft state: the new router starts empty ...
        await _wait_until(lambda: router.workers.get(decode.url) is not None, what="re-learned")
    finally:
        await reg.deregister()
        await router.stop()
    assert time.monotonic() - began < 10


async def test_deregister_is_bounded_when_a_router_hangs(decode):
    never = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await never.wait()
        raise AssertionError("unreachable")

    app = web.Application()
    app.router.add_post("/workers/{what}", hang)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    reg = Registration(replace(FAST, router_urls=(url,), timeout_s=0.3), msg_for(decode))
    try:
        reg.start()
        assert not await reg.wait_registered(0.5)
        began = time.monotonic()
        await reg.deregister()
        assert time.monotonic() - began < 2.0
    finally:
        await runner.cleanup()


async def test_a_router_with_a_registration_token_takes_only_registrations_carrying_it(decode):
    router = Router(
        replace(TEST_CONFIG, health_interval_s=0.05, registration_token="reg-token", api_key="c")
    )
    await router.start()
    config = replace(FAST, router_urls=(router.url,))
    registrations = {
        token: Registration(replace(config, token=token), msg_for(decode))
        for token in (None, "c", "reg-token")  # none, the client key, the token
    }
    try:
        for token in (None, "c"):
            registrations[token].start()
        # Several renewals' worth of tries: still not registered.
        assert not await registrations[None].wait_registered(timeout_s=0.5)
        assert not await registrations["c"].wait_registered(timeout_s=0.1)
        assert router.workers.get(decode.url) is None and decode.num_info_checks == 0
        registrations["reg-token"].start()
        assert await registrations["reg-token"].wait_registered(timeout_s=5)
        assert router.workers.get(decode.url) is not None
    finally:
        for registration in registrations.values():
            await registration.deregister()
        await router.stop()
