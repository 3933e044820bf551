from __future__ import annotations

import logging
import socket

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from pdserve.api import build_app, start_http
from pdserve.api.state import API_CONTEXT

from .conftest import make_config
from .engine_double import FakeEngine


def test_build_app_keeps_its_state_under_a_typed_key() -> None:
    engine = FakeEngine()
    config = make_config(max_n=3)
    app = build_app(engine, config, CollectorRegistry())
    ctx = app[API_CONTEXT]
    assert ctx.engine is engine and ctx.config is config


def test_metrics_are_registered_in_the_given_registry_only() -> None:
    registry = CollectorRegistry()
    build_app(FakeEngine(), make_config(), registry)
    names = {m.name for m in registry.collect()}
    assert {"pdserve_http_requests", "pdserve_http_request_errors"} <= names
    build_app(FakeEngine(), make_config(), CollectorRegistry())  # no global registration clash


@pytest.mark.parametrize("access_log", [False, True])
async def test_start_http_binds_an_ephemeral_port_and_logs_access_only_on_request(
    caplog: pytest.LogCaptureFixture, access_log: bool
) -> None:
    app = build_app(FakeEngine(), make_config(), CollectorRegistry())
    runner, port = await start_http(app, "127.0.0.1", 0, access_log=access_log)
    try:
        assert port > 0
        with caplog.at_level(logging.INFO, logger="aiohttp.access"):
            async with aiohttp.ClientSession() as session:
                resp = await session.get(f"http://127.0.0.1:{port}/health")
                assert resp.status == 200
        access_records = [r for r in caplog.records if r.name == "aiohttp.access"]
        assert bool(access_records) == access_log
    finally:
        await runner.cleanup()


async def test_start_http_on_a_taken_port_raises_and_releases_the_runner() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        app = build_app(FakeEngine(), make_config(), CollectorRegistry())
        with pytest.raises(OSError):
            await start_http(app, "127.0.0.1", port)
