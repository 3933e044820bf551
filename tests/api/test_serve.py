"""Serving over a really bound server: disconnects abort, deadlines end, errors end streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from prometheus_client import CollectorRegistry

from pdserve.api import build_app, start_http

from .conftest import assert_openai_error, chat_body, completion_body, make_config, wait_until
from .engine_double import FakeEngine
from .sse_utils import parse_sse

TIMEOUT = aiohttp.ClientTimeout(total=10)


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as client_session:
        yield client_session


@pytest.mark.parametrize("n", [1, 3])
async def test_disconnect_while_waiting_aborts_every_choice(
    live_url: str, engine: FakeEngine, n: int
) -> None:
    engine.hang_after = 0
    expected = {"gone"} if n == 1 else {f"gone-{i}" for i in range(n)}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as client_session:
        request = asyncio.create_task(
            client_session.post(
                f"{live_url}/v1/completions",
                json=completion_body("abc", n=n),
                headers={"X-Request-Id": "gone"},
            )
        )
        await wait_until(lambda: set(engine.live) == expected)
        request.cancel()  # the client gives up: its connection closes
    await wait_until(lambda: engine.aborted_ids() == expected)
    assert {reason for _, reason in engine.aborts} == {"client_disconnected"}
    await wait_until(lambda: not engine.live)


async def test_disconnect_mid_stream_aborts(
    live_url: str, engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    engine.hang_after = 3
    resp = await session.post(
        f"{live_url}/v1/chat/completions",
        json=chat_body("hello", stream=True),
        headers={"X-Request-Id": "s-gone"},
    )
    assert resp.status == 200
    first = await resp.content.readuntil(b"\n\n")
    assert first.startswith(b"data: ")
    await wait_until(lambda: "s-gone" in engine.live)
    resp.close()  # drop the connection mid-stream
    await wait_until(lambda: engine.aborted_ids() == {"s-gone"})
    metrics = await (await session.get(f"{live_url}/metrics")).text()
    assert 'pdserve_http_request_errors_total{type="client_disconnected"} 1.0' in metrics
    assert 'endpoint="/v1/chat/completions",status="499"' in metrics


async def test_failed_write_counts_as_disconnect_without_handler_cancellation(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    # Without handler cancellation only the next write notices the client is gone.
    app = build_app(engine, make_config(), CollectorRegistry())
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        engine.hang_after = 2
        resp = await session.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json=completion_body("abc", stream=True),
            headers={"X-Request-Id": "w-gone"},
        )
        await resp.content.readuntil(b"\n\n")
        resp.close()
        # The server saw the connection close (its protocol dropped the transport).
        await wait_until(lambda: all(h.transport is None for h in runner.server.connections))
        engine.resume()  # more tokens: the handler's next write fails
        await wait_until(lambda: engine.aborted_ids() == {"w-gone"})
        assert engine.aborts == [("w-gone", "client_disconnected")]
    finally:
        await runner.cleanup()


@pytest_asyncio.fixture
async def deadline_url(engine: FakeEngine) -> AsyncIterator[str]:
    """A server whose requests have a 0.1 s deadline (+0.1 s grace for the backstop)."""
    config = make_config(request_deadline_s=0.1, deadline_grace_s=0.1)
    runner, port = await start_http(build_app(engine, config, CollectorRegistry()), "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("stream", [False, True])
async def test_deadline_backstop_ends_a_stuck_request_with_504(
    deadline_url: str, engine: FakeEngine, session: aiohttp.ClientSession, stream: bool
) -> None:
    engine.hang_after = 0
    resp = await session.post(
        f"{deadline_url}/v1/chat/completions",
        json=chat_body("a", stream=stream),
        headers={"X-Request-Id": "late"},
    )
    assert resp.status == 504
    error = assert_openai_error(await resp.json())
    assert error["code"] == "timeout:request" and error["type"] == "timeout"
    assert engine.requests[0].deadline_s == 0.1
    assert engine.aborted_ids() == {"late"}


async def test_deadline_mid_stream_is_an_sse_error_event(
    deadline_url: str, engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    engine.hang_after = 2
    resp = await session.post(
        f"{deadline_url}/v1/completions", json=completion_body("abc", stream=True)
    )
    assert resp.status == 200
    events, is_done = parse_sse(await resp.read())
    assert is_done and "".join(e["choices"][0]["text"] for e in events[:-1]) == "ab"
    assert assert_openai_error(events[-1])["code"] == "timeout:request"


class _CrashingEngine(FakeEngine):
    """An engine bug (not an EngineError) after two tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_error = RuntimeError("engine bug")  # type: ignore[assignment]
        self.fail_after = 2


async def test_unexpected_error_mid_stream_is_a_generic_error_event(
    session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _CrashingEngine()
    runner, port = await start_http(
        build_app(engine, make_config(), CollectorRegistry()), "127.0.0.1", 0
    )
    try:
        with caplog.at_level(logging.ERROR, logger="pdserve.api.serve"):
            resp = await session.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json=completion_body("abc", stream=True),
            )
            events, is_done = parse_sse(await resp.read())
        assert is_done
        error = assert_openai_error(events[-1])
        assert error["type"] == "server_error" and "engine bug" not in error["message"]
        assert any("engine bug" in (r.exc_text or "") for r in caplog.records)
        ok = await session.post(
            f"http://127.0.0.1:{port}/v1/completions", json=completion_body("a", max_tokens=1)
        )
        assert ok.status == 200  # an engine bug on one request does not stop the server
    finally:
        await runner.cleanup()
