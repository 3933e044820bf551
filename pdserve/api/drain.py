"""Drain: the switch that turns a worker's readiness off and turns new requests away.

Once :meth:`DrainGate.begin` runs (``POST /drain`` or SIGTERM), ``/health/ready`` answers 503,
and new generation requests get a retryable 503 with ``Retry-After`` and an error of type
``draining`` (a router retries it on another worker before the first byte). Requests already
admitted keep running; :class:`pdserve.server.Server` waits for them up to its drain timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from pdserve.api.errors import ApiError

logger = logging.getLogger(__name__)

DRAINING = "draining"  # the error type and code of a request turned away by a drain
# Paths that start new work; everything else (health, metrics, abort, debug) keeps answering.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class DrainGate:
    """Whether this worker is draining, and who to tell when it starts (once)."""

    retry_after_s: int = 2  # what a turned-away client is told to wait
    is_draining: bool = False
    reason: str | None = None
    _listeners: list[Callable[[str], None]] = field(default_factory=list)

    def on_begin(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` when the drain begins (the server's drain task)."""
        self._listeners.append(listener)

    def begin(self, reason: str) -> bool:
        """Start draining; False if already draining (idempotent)."""
        if self.is_draining:
            return False
        self.is_draining = True
        self.reason = reason
        logger.info("drain: serving -> draining (%s)", reason)
        for listener in self._listeners:
            listener(reason)
        return True

    def rejection(self) -> ApiError:
        """The retryable error a request arriving during the drain gets."""
        return ApiError(
            503,
            "This worker is draining and takes no new requests; retry on another worker.",
            err_type=DRAINING,
            code=DRAINING,
            headers={"Retry-After": str(self.retry_after_s)},
        )


def drain_middleware(gate: DrainGate) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Turn new generation requests away while ``gate`` is draining."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if gate.is_draining and request.path in GENERATION_PATHS:
            raise gate.rejection()
        return await handler(request)

    return middleware
