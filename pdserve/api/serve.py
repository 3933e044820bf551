"""Runs a prepared request against the engine and answers it, streamed or not.

Every exit path closes the :class:`ChoiceStreams`, which aborts the choices still running: the
client vanished (handler cancelled, or a failed/stuck SSE write), the engine failed one choice,
the deadline backstop fired, or an unexpected bug.

Streaming headers are sent only once the first delta is ready, so an engine error before any
token is still a plain JSON error with its status (which a router can retry elsewhere), unless
the first delta takes longer than the keep-alive period (``ApiConfig.sse_keepalive_s``): then
the stream opens with ``: keep-alive`` comments, one a period, and an error that comes before
the first delta is an SSE error event. A router asks for none (pdserve.keepalive): it sends
its own to the client and keeps its freedom to retry elsewhere until the first data chunk.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
from aiohttp import web

from pdserve.api.errors import ApiError, from_engine_error, internal_error
from pdserve.api.generation import ChoiceStreams
from pdserve.api.metrics import CLIENT_DISCONNECTED
from pdserve.api.prepare import PreparedRequest
from pdserve.api.responses import ResponseBuilder
from pdserve.api.sse import ClientGone, SseWriter, encode_event
from pdserve.api.state import CLIENT_GONE, ApiContext
from pdserve.auth import ANONYMOUS, CALLER
from pdserve.engine.protocol import EngineError, GenerateOutput
from pdserve.keepalive import KEEPALIVE_EVENT, KEEPALIVE_HEADER, KeepAlive

logger = logging.getLogger(__name__)


async def serve_prepared(
    request: web.Request, ctx: ApiContext, prepared: PreparedRequest, builder: ResponseBuilder
) -> web.StreamResponse:
    """Generate every choice of ``prepared`` and respond; always aborts what is left running."""
    rid = prepared.request_id
    caller = request.get(CALLER)
    ctx.owners.start(rid, caller.owner if caller is not None else ANONYMOUS)
    try:
        return await _serve(request, ctx, prepared, builder)
    finally:
        ctx.owners.end(rid)


async def _serve(
    request: web.Request, ctx: ApiContext, prepared: PreparedRequest, builder: ResponseBuilder
) -> web.StreamResponse:
    rid = prepared.request_id
    streams = _open_streams(ctx, prepared)
    writer = None
    if prepared.options.stream:
        headers = {"X-Request-Id": rid}
        writer = SseWriter(request, headers, ctx.config.write_timeout_s)
    close_reason = "client_disconnected"  # what the engine hears if we leave before the end
    try:
        if writer is None:
            response = await _collect(streams, builder)
        else:
            await _stream(writer, ctx, streams, builder, _keepalive_s(request, ctx))
            response = writer.response
        close_reason = "ended"
        return response
    except ClientGone as exc:
        # A failed or stuck write: same ending as a cancelled handler.
        logger.info("request %s: client gone mid-stream (%s)", rid, exc)
        ctx.metrics.observe_error(CLIENT_DISCONNECTED)
        request[CLIENT_GONE] = True
        assert writer is not None
        return writer.response
    except (ApiError, EngineError) as exc:
        err = from_engine_error(exc) if isinstance(exc, EngineError) else exc
        close_reason = f"error:{err.code or err.err_type}"
        logger.info("request %s: failed with %s: %s", rid, err.status, err.message)
        raise err from None
    except asyncio.CancelledError:
        logger.info("request %s: client disconnected", rid)
        ctx.metrics.observe_error(CLIENT_DISCONNECTED)
        raise
    except Exception:
        close_reason = "error:internal"  # logged with its traceback by the error middleware
        raise
    finally:
        await streams.aclose(close_reason)
        logger.debug("request %s: done (%s)", rid, close_reason)


def _open_streams(ctx: ApiContext, prepared: PreparedRequest) -> ChoiceStreams:
    config = ctx.config
    deadline_s = None
    if config.request_deadline_s is not None:
        # The engine enforces the deadline itself; this backstop only catches a stuck engine.
        deadline_s = config.request_deadline_s + config.deadline_grace_s
    streams = ChoiceStreams(
        ctx.engine, prepared.engine_requests, config.abort_timeout_s, deadline_s
    )
    logger.debug(
        "request %s: admitted, %d choice(s), prompt tokens %s, stream=%s",
        prepared.request_id,
        prepared.num_choices,
        prepared.prompt_lens,
        prepared.options.stream,
    )
    streams.start()
    return streams


async def _collect(streams: ChoiceStreams, builder: ResponseBuilder) -> web.Response:
    while batch := await streams.next_batch():
        for index, out in batch:
            builder.add(index, out)
    return web.Response(
        body=orjson.dumps(builder.response()),
        content_type="application/json",
        headers={"X-Request-Id": builder.prepared.request_id},
    )


def _keepalive_s(request: web.Request, ctx: ApiContext) -> float:
    """The keep-alive period for this stream: 0 (none) when a router holds the client."""
    if request.headers.get(KEEPALIVE_HEADER) == "0":
        return 0.0
    return ctx.config.sse_keepalive_s


async def _first_batch(
    writer: SseWriter, streams: ChoiceStreams, keepalive_s: float
) -> list[tuple[int, GenerateOutput]]:
    """The first deltas; while they take longer than ``keepalive_s``, the stream opens and
    gets a comment every period."""
    if keepalive_s <= 0:
        return await streams.next_batch()

    async def send() -> None:
        try:
            await writer.open()
            await writer.send(KEEPALIVE_EVENT)
        except ClientGone as exc:
            raise ConnectionError(str(exc)) from exc

    ticks = KeepAlive(keepalive_s, send)
    ticks.start()
    try:
        return await streams.next_batch()
    finally:
        await ticks.stop()


async def _stream(
    writer: SseWriter,
    ctx: ApiContext,
    streams: ChoiceStreams,
    builder: ResponseBuilder,
    keepalive_s: float = 0.0,
) -> None:
    try:
        batch = await _first_batch(writer, streams, keepalive_s)
    except (ApiError, EngineError) as exc:
        if not writer.is_open:
            raise  # nothing sent yet: still a plain JSON error with its status
        await _fail_open_stream(writer, ctx, streams, builder, exc)  # after keep-alives
        await writer.finish()
        return
    await writer.open()
    events = [encode_event(c) for c in builder.opening_chunks()]
    try:
        while batch:
            events.extend(_encode_batch(builder, batch))
            if events:
                await writer.send(b"".join(events))  # one write per batch, not per chunk
                events = []
            batch = await streams.next_batch()
        closing = builder.closing_chunks()
        if closing:
            await writer.send(b"".join(encode_event(c) for c in closing))
    except (ApiError, EngineError) as exc:
        await _fail_open_stream(writer, ctx, streams, builder, exc)
    except ClientGone:
        raise
    except Exception:
        logger.exception("request %s: unexpected error mid-stream", builder.prepared.request_id)
        await _send_error(writer, ctx, streams, internal_error())
    await writer.finish()


def _encode_batch(builder: ResponseBuilder, batch: list[tuple[int, GenerateOutput]]) -> list[bytes]:
    events = []
    for index, out in batch:
        chunk = builder.chunk(index, out)
        if chunk is not None:
            events.append(encode_event(chunk))
    return events


async def _fail_open_stream(
    writer: SseWriter,
    ctx: ApiContext,
    streams: ChoiceStreams,
    builder: ResponseBuilder,
    exc: ApiError | EngineError,
) -> None:
    err = from_engine_error(exc) if isinstance(exc, EngineError) else exc
    logger.info(
        "request %s: failed mid-stream with %s: %s",
        builder.prepared.request_id, err.status, err.message,
    )  # fmt: skip
    await _send_error(writer, ctx, streams, err)


async def _send_error(
    writer: SseWriter, ctx: ApiContext, streams: ChoiceStreams, err: ApiError
) -> None:
    # Headers are out: the error travels as an SSE event, then [DONE]. Abort the other choices
    # first so nothing keeps running for a stream that is about to end.
    ctx.metrics.observe_error(err.err_type)
    await streams.aclose(f"error:{err.code or err.err_type}")
    await writer.send(encode_event(err.to_dict()))
