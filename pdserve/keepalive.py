"""SSE keep-alive: comment lines sent to a client while its stream has no data yet.

A proxy or SDK with an idle-read timeout drops a stream whose prompt prefills for longer than
that; an SSE comment (``: keep-alive``) keeps the connection busy and every SSE parser skips
it. Whichever process holds the client's connection sends them: the router where there is
one (it tells its workers not to, with :data:`KEEPALIVE_HEADER`, so that until the first data
chunk it may still retry the request on another worker), else the worker. Below both layers:
imports nothing of pdserve.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

KEEPALIVE_EVENT = b": keep-alive\n\n"
# Request header a router sends its workers: "0" means "send no keep-alive, I do".
KEEPALIVE_HEADER = "X-PDServe-SSE-Keepalive"


class KeepAlive:
    """Calls ``send`` every ``period_s`` seconds from :meth:`start` until :meth:`stop`.

    ``send`` raising ``ConnectionError`` (the client left) ends the ticks quietly; the
    caller's next write finds out. :meth:`stop` returns only once no ``send`` runs, so the
    caller may write its first data chunk right after it."""

    def __init__(self, period_s: float, send: Callable[[], Awaitable[None]]) -> None:
        if not period_s > 0:
            raise ValueError(f"the keep-alive period must be > 0 s, got {period_s}")
        self.period_s = period_s
        self._send = send
        self._task: asyncio.Task[None] | None = None
        self.num_sent = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="sse-keepalive")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.wait({task})  # unlike awaiting it, lets our own cancellation through

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)  # the period itself, not a wait for a condition
            try:
                await self._send()
            except ConnectionError as exc:
                logger.debug("keep-alive: client gone (%s)", exc)
                return
            self.num_sent += 1
