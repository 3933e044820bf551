"""OpenAI-style errors: one exception type for every client-visible failure, and its JSON body.

Body shape: ``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from pdserve.engine.protocol import EngineError

INVALID_REQUEST = "invalid_request_error"


class ApiError(Exception):
    """A request that ends with an OpenAI error body and ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        err_type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error object (what goes in a JSON body or an SSE error event)."""
        return error_body(self.message, self.err_type, self.param, self.code)

    def to_response(self, headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(
            status=self.status,
            body=orjson.dumps(self.to_dict()),
            content_type="application/json",
            headers={**self.headers, **(headers or {})},
        )


def error_body(
    message: str, err_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400 invalid_request_error."""
    return ApiError(400, message, param=param, code=code)


def unrecognized_argument(name: str) -> ApiError:
    """OpenAI's wording for a field it does not know."""
    return ApiError(400, f"Unrecognized request argument supplied: {name}", param=name)


def unsupported(name: str, detail: str) -> ApiError:
    """A field OpenAI knows but this server cannot honour."""
    return ApiError(400, f"'{name}' is not supported by this server: {detail}", param=name)


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def internal_error() -> ApiError:
    """Generic 500: the traceback goes to the log, never to the client."""
    return ApiError(
        500,
        "The server had an error while processing your request.",
        err_type="server_error",
        code="internal_error",
    )


def from_engine_error(err: EngineError) -> ApiError:
    """Map an engine failure (timeout, lost peer, ...) to the status it asked for."""
    status = err.status if 400 <= err.status <= 599 else 503
    return ApiError(status, err.message, err_type=err.err_type, code=err.code)
