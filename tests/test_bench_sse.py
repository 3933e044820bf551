"""bench/sse.py reads an OpenAI-style SSE body the way the benchmarks and e2e tests need it:
data lines as JSON, comments and blank lines skipped, [DONE] as its own event, the body read on
to its end after [DONE], each event stamped when its line arrived."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sse import SseEvent, choice_text, sse_events  # noqa: E402


async def _serve(body: list[bytes], gap_s: float = 0.0) -> AsyncIterator[str]:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in body:
            await resp.write(part)
            await asyncio.sleep(gap_s)  # spaces the lines out, for their arrival stamps
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/s", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/s"
    finally:
        await runner.cleanup()


async def _read(body: list[bytes], gap_s: float = 0.0) -> list[SseEvent]:
    async for url in _serve(body, gap_s):
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as s, s.get(url) as resp:
            return [e async for e in sse_events(resp)]
    raise AssertionError("unreachable")


async def test_data_lines_become_events_and_done_is_its_own_event() -> None:
    body = [
        b": keep-alive comment\n\n",
        b'data: {"choices": [{"text": "a"}]}\n\n',
        b'data:{"choices": [{"delta": {"content": "b"}}]}\r\n\r\n',
        b"data: [DONE]\n\n",
        b'data: {"late": true}\n\n',  # after [DONE]: still read, the body goes to its end
    ]
    events = await _read(body)
    assert [e.data for e in events] == [
        {"choices": [{"text": "a"}]},
        {"choices": [{"delta": {"content": "b"}}]},
        None,
        {"late": True},
    ]
    assert [e.is_done for e in events] == [False, False, True, False]
    assert [choice_text(e.data["choices"][0]) for e in events[:2] if e.data] == ["a", "b"]


async def test_each_event_is_stamped_when_its_line_arrived() -> None:
    body = [b'data: {"i": %d}\n\n' % i for i in range(3)]
    events = await _read(body, gap_s=0.05)
    gaps = [b.at - a.at for a, b in zip(events, events[1:], strict=False)]
    assert len(events) == 3 and all(g >= 0.03 for g in gaps), gaps


async def test_a_line_that_is_not_json_raises_a_value_error() -> None:
    with pytest.raises(ValueError):
        await _read([b"data: {not json\n\n"])
