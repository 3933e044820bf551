"""OpenAI-style error bodies, as JSON responses and as SSE events."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}


def error_payload(
    message: str, err_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    *,
    err_type: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """A JSON error response in the OpenAI shape; the type defaults from the status."""
    err_type = err_type or _TYPE_BY_STATUS.get(status, "server_error")
    body = orjson.dumps(error_payload(message, err_type, param=param, code=code))
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def sse_error_event(message: str, err_type: str = "server_error", code: str | None = None) -> bytes:
    """The SSE error event that ends a stream after the first byte, followed by ``[DONE]``."""
    payload = orjson.dumps(error_payload(message, err_type, code=code))
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"
