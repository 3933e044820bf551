"""Server-sent events as OpenAI streams them: ``data: <json>\\n\\n`` ... ``data: [DONE]\\n\\n``."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

DONE = b"data: [DONE]\n\n"


def encode_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class ClientGone(Exception):
    """The client closed the connection, or stopped reading for longer than the write timeout."""


class SseWriter:
    """Writes events to one client; any failed or stuck write means the client is gone."""

    def __init__(
        self, request: web.Request, headers: dict[str, str], write_timeout_s: float
    ) -> None:
        self._request = request
        self._write_timeout_s = write_timeout_s
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                # Proxies such as nginx would otherwise buffer the stream.
                "X-Accel-Buffering": "no",
                **headers,
            },
        )

    @property
    def is_open(self) -> bool:
        return self.response.prepared

    async def open(self) -> None:
        await self._guarded(self.response.prepare(self._request), self._write_timeout_s)

    async def send(self, data: bytes) -> None:
        """Write already-encoded events (several may be joined into one write)."""
        # Unless the transport is paused it takes the bytes at once: the write cannot block, so
        # it needs no timer (a timer per event is a measurable share of a token's cost).
        timeout_s = self._write_timeout_s if self._request.protocol.writing_paused else None
        await self._guarded(self.response.write(data), timeout_s)

    async def finish(self) -> None:
        """``[DONE]`` then end of body."""
        await self.send(DONE)
        await self._guarded(self.response.write_eof(), self._write_timeout_s)

    async def _guarded(self, op: Any, timeout_s: float | None) -> None:
        """``op``, bounded by ``timeout_s`` (None: no timer); any failure means the client left."""
        try:
            async with asyncio.timeout(timeout_s):
                await op
        except (ConnectionError, TimeoutError) as exc:
            raise ClientGone(str(exc) or type(exc).__name__) from exc
