"""A worker serving a client itself sends ``: keep-alive`` SSE comments while a stream waits for
its first token (ApiConfig.sse_keepalive_s), so a client with an idle-read timeout shorter than
the prefill keeps its stream; a router's requests (KEEPALIVE_HEADER 0) and non-streaming
requests get none."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from openai import AsyncOpenAI

from pdserve.api import ApiConfig
from pdserve.engine.protocol import EngineError
from pdserve.keepalive import KEEPALIVE_EVENT, KEEPALIVE_HEADER

from .conftest import API_KEY, chat_body, make_config, wait_until
from .engine_double import FakeEngine
from .sse_utils import parse_sse

PERIOD_S = 0.2


@pytest.fixture
def config() -> ApiConfig:
    return make_config(sse_keepalive_s=PERIOD_S)


@pytest.fixture
def engine() -> FakeEngine:
    held = FakeEngine()
    held.hang_after = 0  # the first token waits until the test resumes it: a long prefill
    return held


async def _read_stream(
    url: str, body: dict[str, Any], engine: FakeEngine, *, num_comments: int,
    headers: dict[str, str] | None = None, idle_timeout_s: float = 2 * PERIOD_S,
) -> bytes:  # fmt: skip
    """POST a streamed request with an idle-read timeout; resume the engine once
    ``num_comments`` keep-alives arrived (0: at once); the whole body read."""
    timeout = aiohttp.ClientTimeout(total=30, sock_read=idle_timeout_s)
    raw = b""
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp,
    ):
        if num_comments == 0:
            engine.resume()
        async for chunk in resp.content.iter_any():
            raw += chunk
            if num_comments and raw.count(KEEPALIVE_EVENT) >= num_comments:
                engine.resume()
    return raw


async def test_a_stream_gets_comments_while_it_prefills_then_its_tokens(
    live_url: str, engine: FakeEngine
) -> None:
    """Held for more than 3 periods; the client's 2-period idle timeout never fires."""
    body = chat_body("hello", max_tokens=4, stream=True)
    raw = await _read_stream(live_url, body, engine, num_comments=3)
    head, _, rest = raw.rpartition(KEEPALIVE_EVENT)
    assert head.count(KEEPALIVE_EVENT) >= 2 and b"data:" not in head  # comments come first
    assert KEEPALIVE_EVENT not in rest  # none once the data flows
    chunks, is_done = parse_sse(rest)
    assert is_done
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "<use"


async def test_without_keep_alive_the_same_client_times_out(
    live_url: str, engine: FakeEngine, config: ApiConfig
) -> None:
    """The control: a router's request (no comments asked) is idle for longer than the
    client's timeout, so that timeout is what the keep-alives defeat."""
    body = chat_body("hello", max_tokens=4, stream=True)
    with pytest.raises(TimeoutError):
        await _read_stream_held(live_url, body, {KEEPALIVE_HEADER: "0"})
    await wait_until(lambda: not engine.live)  # the worker saw its client leave
    engine.resume()


async def _read_stream_held(url: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    timeout = aiohttp.ClientTimeout(total=30, sock_read=2 * PERIOD_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp,
    ):
        await resp.read()


async def test_an_error_after_keep_alives_ends_the_stream_with_an_error_event(
    live_url: str, engine: FakeEngine
) -> None:
    engine.hang_after = None
    engine.fail_error = EngineError("prefill failed", 503, "service_unavailable", "test_fail")
    engine.fail_after = 0
    gate = asyncio.Event()
    generate = engine._generate

    async def held(request: Any) -> Any:  # the failure comes after 2 periods
        await gate.wait()
        async for out in generate(request):
            yield out

    engine._generate = held  # type: ignore[method-assign]
    body = chat_body("hello", max_tokens=4, stream=True)
    timeout = aiohttp.ClientTimeout(total=30, sock_read=2 * PERIOD_S)
    raw = b""
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(f"{live_url}/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200
        async for chunk in resp.content.iter_any():
            raw += chunk
            if raw.count(KEEPALIVE_EVENT) >= 2:
                gate.set()
    chunks, is_done = parse_sse(raw.replace(KEEPALIVE_EVENT, b""))
    assert is_done and chunks[-1]["error"]["code"] == "test_fail"


async def test_the_openai_client_streams_through_keep_alives(
    live_url: str, engine: FakeEngine
) -> None:
    """The SDK's own read timeout is 2 periods; the held prefill lasts 3."""
    client = AsyncOpenAI(
        base_url=f"{live_url}/v1", api_key=API_KEY, max_retries=0,
        timeout=openai.Timeout(10.0, read=2 * PERIOD_S),
    )  # fmt: skip
    try:
        stream = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            stream=True,
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        resume_at = loop.time() + 3 * PERIOD_S
        loop.call_at(resume_at, engine.resume)  # the held prefill ends after 3 periods
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "<us"
    finally:
        await client.close()


async def test_a_non_streaming_request_gets_no_comments(live_url: str, engine: FakeEngine) -> None:
    """Held as long as a stream beside it that got two comments meanwhile."""
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        plain = asyncio.create_task(
            session.post(f"{live_url}/v1/chat/completions", json=chat_body("hi", max_tokens=2))
        )
        await wait_until(lambda: bool(engine.live))
        streamed = chat_body("hello", max_tokens=4, stream=True)
        raw = await _read_stream(live_url, streamed, engine, num_comments=2)
        assert raw.count(KEEPALIVE_EVENT) >= 2
        async with await plain as resp:
            body = await resp.read()
    assert KEEPALIVE_EVENT not in body
    assert orjson.loads(body)["choices"][0]["message"]["content"] == "<u"
