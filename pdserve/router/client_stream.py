"""The client's side of a streamed request while no attempt has its first data chunk yet:
``: keep-alive`` comments every period (``RouterConfig.sse_keepalive_s``), which open the
client's SSE response early (status 200) so that an idle-read timeout in the client or a proxy
does not drop a stream whose prompt prefills for long. The router keeps its freedom to retry
the request on another worker until the first data chunk: a retry writes into the same
response, and a request every attempt failed ends it with an error event."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from pdserve.keepalive import KEEPALIVE_EVENT, KeepAlive

logger = logging.getLogger(__name__)


class ClientStream:
    """One client's SSE response, opened by the first keep-alive comment (if any)."""

    def __init__(self, request: web.Request, request_id: str, period_s: float) -> None:
        self._request = request
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": request_id,
            },
        )
        self._ticks = KeepAlive(period_s, self._tick)

    async def _tick(self) -> None:
        if not self.response.prepared:
            await self.response.prepare(self._request)
        await self.response.write(KEEPALIVE_EVENT)

    def start(self) -> None:
        self._ticks.start()

    async def take(self) -> web.StreamResponse | None:
        """Stop the comments; the response if they opened it (then its status, 200, is sent
        and what follows must be SSE), else None."""
        await self._ticks.stop()
        return self.response if self.response.prepared else None

    async def end_with_error(self, event: bytes, timeout_s: float) -> web.StreamResponse:
        """After comments opened the stream, every attempt failed: the error as an SSE event
        (``event`` ends with ``data: [DONE]``)."""
        with contextlib.suppress(ConnectionError, TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.response.write(event)
        return self.response
