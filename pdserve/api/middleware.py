"""Middlewares: request metrics (outermost), OpenAI-style errors, then access (pdserve/auth.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from pdserve.api.errors import INVALID_REQUEST, ApiError, internal_error
from pdserve.api.metrics import STATUS_CLIENT_CLOSED, HttpMetrics
from pdserve.api.state import CLIENT_GONE
from pdserve.auth import CALLER, AccessPolicy, Denial

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _endpoint(request: web.Request) -> str:
    # The route template, not the raw path: bounded label cardinality (ids stay out).
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def metrics_middleware(metrics: HttpMetrics) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Counts every request by endpoint and status (499 when the client went away)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        try:
            response = await handler(request)
            status = STATUS_CLIENT_CLOSED if request.get(CLIENT_GONE) else response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = STATUS_CLIENT_CLOSED
            raise
        finally:
            metrics.observe_request(_endpoint(request), status)

    return middleware


def error_middleware(metrics: HttpMetrics) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Every failure becomes ``{"error": {...}}``; never a traceback, never a dead server."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as err:
            metrics.observe_error(err.err_type)
            return err.to_response()
        except web.HTTPException as exc:  # routing (404, 405) and aiohttp's own limits
            metrics.observe_error(INVALID_REQUEST)
            return _from_http_exception(exc)
        except Exception:
            logger.exception("unhandled error in %s %s", request.method, request.path)
            err = internal_error()
            metrics.observe_error(err.err_type)
            return err.to_response()

    return middleware


def _from_http_exception(exc: web.HTTPException) -> web.Response:
    headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    err = ApiError(
        exc.status,
        exc.reason if exc.status != 404 else "Not found: no such endpoint.",
        code=_HTTP_CODES.get(exc.status),
    )
    return err.to_response(headers=headers)


def auth_middleware(policy: AccessPolicy) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Each route answers only to its credential (pdserve/auth.py); the caller is left in
    ``request[CALLER]`` for the handlers that ask whose request it is (aborts)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        decision = policy.decide(
            policy.kind_of(request), request.headers.get("Authorization"), request.remote
        )
        if isinstance(decision, Denial):
            err_type = "authentication_error" if decision.status == 401 else "permission_error"
            raise ApiError(
                decision.status,
                decision.message,
                err_type=err_type,
                code=decision.code,
                headers=decision.headers,
            )
        request[CALLER] = decision
        return await handler(request)

    return middleware
