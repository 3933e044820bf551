"""Small client helpers shared by the router tests."""

from __future__ import annotations

from typing import Any

import aiohttp

from pdserve.router import Router

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def post(
    router: Router, body: Any, *, rid: str | None = None, path: str = "/v1/chat/completions"
) -> tuple[int, bytes]:
    """POST a JSON body to the router; (status, raw body)."""
    headers = {"X-Request-Id": rid} if rid else {}
    async with (
        aiohttp.ClientSession() as session,
        session.post(router.url + path, json=body, headers=headers) as resp,
    ):
        return resp.status, await resp.read()


def sse_events(raw: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [e[len(b"data: ") :] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
