"""Reading a request body under a size limit and a time limit, and decoding it with orjson."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from pdserve.api.errors import ApiError, bad_request
from pdserve.api.validation import json_type_name


def too_large(max_bytes: int, size: int | None = None) -> ApiError:
    got = "" if size is None else f" ({size} bytes)"
    return ApiError(
        413,
        f"Request body is too large{got}: the limit is {max_bytes} bytes.",
        code="request_too_large",
    )


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The raw body; 413 past ``max_bytes`` (before reading when Content-Length says so)."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large(max_bytes, request.content_length)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > max_bytes:  # chunked uploads announce no length
                    raise too_large(max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(
            408, f"Request body not received within {timeout_s:g} s.", code="request_timeout"
        ) from None
    return b"".join(chunks)


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object; 400 for empty, invalid UTF-8, malformed or non-object bodies."""
    if not raw.strip():
        raise bad_request("Request body is empty: expected a JSON object.", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            raise bad_request("Request body is not valid UTF-8.", code="invalid_encoding") from None
        raise bad_request(
            f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise bad_request(
            f"Request body must be a JSON object, not {json_type_name(body)}.",
            code="invalid_json",
        )
    return body


async def read_json_object(
    request: web.Request, max_bytes: int, timeout_s: float
) -> dict[str, Any]:
    """:func:`read_body` then :func:`decode_json_object`."""
    return decode_json_object(await read_body(request, max_bytes, timeout_s))
