"""The router holds the client's connection, so it sends the keep-alive comments while a stream
has no data yet (its workers are asked for none), and until the first data chunk it still
retries a prefill that fails on another worker."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest

from pdserve.keepalive import KEEPALIVE_EVENT
from pdserve.router import Router

from .helpers import CHAT, sse_events

PERIOD_S = 0.2
STREAM = {**CHAT, "stream": True}


async def read_stream(
    router: Router, body: dict[str, Any], hold: asyncio.Event, num_comments: int,
    rid: str = "ka-1",
) -> tuple[int, bytes]:  # fmt: skip
    """The client: an idle-read timeout of 2 periods; sets ``hold`` (the held prefill ends)
    once ``num_comments`` comments came. (status, raw body)."""
    timeout = aiohttp.ClientTimeout(total=30, sock_read=2 * PERIOD_S)
    raw = b""
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(router.url + "/v1/chat/completions", json=body,
                     headers={"X-Request-Id": rid}) as resp,
    ):  # fmt: skip
        async for chunk in resp.content.iter_any():
            raw += chunk
            if raw.count(KEEPALIVE_EVENT) >= num_comments:
                hold.set()
        return resp.status, raw


def split(raw: bytes) -> tuple[bytes, bytes]:
    """(the comments before the first data event, the rest)."""
    start = raw.index(b"data:")
    return raw[:start], raw[start:]


async def test_a_slow_prefill_gets_comments_then_tokens_and_the_workers_send_none(
    make_worker, make_router
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.hold = asyncio.Event()
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(decode.url,), sse_keepalive_s=PERIOD_S
    )
    status, raw = await read_stream(router, STREAM, prefill.hold, num_comments=3)
    comments, rest = split(raw)
    assert status == 200 and comments.count(KEEPALIVE_EVENT) >= 3
    assert comments == KEEPALIVE_EVENT * comments.count(KEEPALIVE_EVENT)
    assert KEEPALIVE_EVENT not in rest and sse_events(rest)[-1] == b"[DONE]"
    assert len(sse_events(rest)) == decode.num_chunks + 2  # every chunk, the last, [DONE]
    assert [r.keepalive for r in prefill.requests + decode.requests] == ["0", "0"]


async def test_a_prefill_that_fails_after_comments_is_retried_on_another(make_worker, make_router):
    bad, good = await make_worker("prefill"), await make_worker("prefill")
    decode = await make_worker("decode")
    bad.hold, bad.fail_status = asyncio.Event(), 503
    router = await make_router(
        prefill_urls=(bad.url, good.url), decode_urls=(decode.url,), max_attempts=3,
        policy="round_robin", sse_keepalive_s=PERIOD_S,
    )  # fmt: skip
    status, raw = await read_stream(router, STREAM, bad.hold, num_comments=2)
    comments, rest = split(raw)
    assert status == 200 and comments.count(KEEPALIVE_EVENT) >= 2
    assert bad.rids() == ["ka-1"] and good.rids() == ["ka-1.1"]  # retried after the comments
    assert sse_events(rest)[-1] == b"[DONE]" and b"error" not in rest
    assert router.stats.num_retries == 1


async def test_every_attempt_failing_after_comments_ends_the_stream_with_its_error(
    make_worker, make_router
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.hold, prefill.fail_status, prefill.fail_code = asyncio.Event(), 400, "bad_field"
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(decode.url,), sse_keepalive_s=PERIOD_S
    )
    status, raw = await read_stream(router, STREAM, prefill.hold, num_comments=2)
    _, rest = split(raw)
    events = sse_events(rest)
    assert status == 200 and events[-1] == b"[DONE]"
    assert orjson.loads(events[0])["error"]["code"] == "bad_field"


@pytest.mark.parametrize("period_s", [0.0, PERIOD_S])
async def test_non_streaming_requests_and_keep_alive_off_get_no_comments(
    make_worker, make_router, period_s: float
):
    """A non-streamed answer held as long as a stream that got two comments (or, with
    keep-alive off, a stream whose client timed out) is plain JSON."""
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    prefill.hold = asyncio.Event()
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=(decode.url,), sse_keepalive_s=period_s
    )
    async with aiohttp.ClientSession() as session:
        plain = asyncio.create_task(session.post(router.url + "/v1/chat/completions", json=CHAT))
        if period_s:
            status, raw = await read_stream(router, STREAM, prefill.hold, 2, rid="ka-2")
            assert status == 200 and raw.count(KEEPALIVE_EVENT) >= 2
        else:
            with pytest.raises(TimeoutError):  # nothing for 2 periods: the client gives up
                await read_stream(router, STREAM, asyncio.Event(), 1, rid="ka-2")
            prefill.hold.set()
        async with await plain as resp:
            body = await resp.read()
    assert resp.status == 200 and KEEPALIVE_EVENT not in body
    assert orjson.loads(body)["choices"]
