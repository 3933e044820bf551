"""Operational endpoints: liveness, readiness, metrics, identity, debug listings, aborts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdserve.api.errors import ApiError, bad_request
from pdserve.api.options import is_valid_id
from pdserve.api.prepare import choice_id
from pdserve.api.state import api_context
from pdserve.auth import CALLER, may_abort
from pdserve.engine.protocol import EngineClient

logger = logging.getLogger(__name__)


def _json(payload: Any, status: int = 200) -> web.Response:
    # default=str: debug listings may carry enums or paths; they must still render.
    return web.Response(
        status=status, body=orjson.dumps(payload, default=str), content_type="application/json"
    )


async def health(request: web.Request) -> web.Response:
    """GET /health: the process is alive and its event loop answers."""
    return _json({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """GET /health/ready: 200 once the engine can serve; 503 before that and while draining."""
    ctx = api_context(request)
    if ctx.drain.is_draining:
        raise ctx.drain.rejection()
    if ctx.engine.is_ready():
        return _json({"status": "ready"})
    raise ApiError(
        503, "The engine is not ready.", err_type="service_unavailable", code="not_ready"
    )


async def drain(request: web.Request) -> web.Response:
    """POST /drain: stop taking requests, finish those in flight, then exit (as SIGTERM does).

    Authenticated like the other admin endpoints; idempotent (202 both times)."""
    gate = api_context(request).drain
    started = gate.begin("POST /drain")
    return _json({"draining": True, "started": started}, status=202)


def metrics_handler(
    registry: CollectorRegistry,
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """GET /metrics for ``registry`` (which the server's own collectors also live in)."""

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    return metrics


async def server_info(request: web.Request) -> web.Response:
    """GET /server_info: who this worker is (the router learns bootstrap addresses here)."""
    ctx = api_context(request)
    info = ctx.engine.info
    return _json(
        {
            "role": info.role,
            "model": info.model_name,
            "served_model_name": ctx.config.served_model_name,
            "engine_id": info.engine_id,
            "incarnation": info.incarnation,
            "bootstrap_port": info.bootstrap_port,
            "max_model_len": info.max_model_len,
            "dtype": info.dtype,
            "kv_layout": info.kv_layout,
            "weights": info.weights,
            "extra": info.extra,
            # What the router's health probe weighs workers by (router/workers.py WorkerLoad).
            "load": {**ctx.engine.load(), "draining": ctx.drain.is_draining},
        }
    )


async def debug_requests(request: web.Request) -> web.Response:
    """GET /debug/requests: every live request in the engine (empty when idle)."""
    return _json({"data": api_context(request).engine.debug_requests()})


async def debug_rooms(request: web.Request) -> web.Response:
    """GET /debug/rooms: every live KV hand-off room (empty when idle)."""
    return _json({"data": api_context(request).engine.debug_rooms()})


async def abort(request: web.Request) -> web.Response:
    """POST /abort/{request_id}: end the request and its per-choice requests, at any stage.
    An admin aborts any request; a client only one its key started (404 otherwise).

    A request with several choices runs as ``{rid}-0`` .. ``{rid}-{n-1}``; the caller (a router)
    only knows ``rid``, so those ids are aborted too (unknown ids are no-ops in the engine).
    """
    ctx = api_context(request)
    rid = request.match_info["request_id"]
    if not is_valid_id(rid):
        raise bad_request(
            "Request id must be 1..128 characters of [A-Za-z0-9._:-].", param="request_id"
        )
    caller = request.get(CALLER)
    if caller is None or not may_abort(caller, ctx.owners.get(rid)):
        # Not live, or another client's: the same answer, so ids of others cannot be probed.
        raise ApiError(
            404, f"No request {rid} of yours is in flight.", param="request_id", code="not_found"
        )
    max_n = ctx.config.max_n
    ids = dict.fromkeys([rid, *(choice_id(rid, i, max_n) for i in range(max_n))])
    timeout_s = ctx.config.abort_timeout_s
    results = await asyncio.gather(*(_abort_one(ctx.engine, i, timeout_s) for i in ids))
    aborted = any(results)
    logger.info("request %s: abort requested over HTTP, aborted=%s", rid, aborted)
    return _json({"aborted": aborted})


async def _abort_one(engine: EngineClient, request_id: str, timeout_s: float) -> bool:
    try:
        async with asyncio.timeout(timeout_s):
            return await engine.abort(request_id, "abort_requested")
    except TimeoutError:
        logger.warning("request %s: engine.abort timed out after %ss", request_id, timeout_s)
        return False
