"""Whether an engine can still compute, and its end when it cannot.

At TP1 a failed step fails its batch and the engine serves on. With tensor-parallel ranks
(:mod:`pdserve.parallel.ranks`) the engine is the unit: a rank that dies, or a step that fails
once the other ranks may have run part of it (their collectives no longer meet rank 0's), ends
the engine. Every request in it then fails naming the cause, every later one is refused, and
the listeners (``pdserve serve``: stop and exit non-zero, so supervisors and routers see the
worker gone) hear it once. A death while idle is seen through the ranks' pidfds, as a reader
on the event loop: the loop is this state's only writer.

The engine's stop releases the runner here too (:meth:`EngineHealth.close`): its rank
processes end with the engine that used them, whoever built the runner.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pdserve.engine.protocol import EngineError
from pdserve.engine.request import Request
from pdserve.model_runner import ModelRunner
from pdserve.parallel.ranks import RankDied, RankProcesses

logger = logging.getLogger(__name__)

# A step failed in a collective: how long to wait for the rank death that likely caused it
# (a killed rank's sockets close a moment before its exit status can be read).
DEATH_GRACE_S = 2.0


class EngineHealth:
    """One engine's: ``requests`` is its table of admitted requests (read here, never
    written), ``fail`` how one of them ends in error."""

    def __init__(
        self,
        runner: ModelRunner,
        requests: dict[str, Request],
        fail: Callable[[Request, EngineError], None],
    ) -> None:
        self._runner = runner
        self._requests = requests
        self._fail = fail
        self.error: EngineError | None = None  # set once: why the engine can compute no more
        self._listeners: list[Callable[[EngineError], None]] = []
        self._watched: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def _ranks(self) -> RankProcesses | None:
        # ModelRunner keeps them private (its file is at the size limit); None at TP1.
        return self._runner._ranks

    def on_fatal(self, listener: Callable[[EngineError], None]) -> None:
        """Call ``listener`` (on the event loop) when the engine ends; at once if it has."""
        if self.error is not None:
            listener(self.error)
        else:
            self._listeners.append(listener)

    def refusal(self) -> EngineError:
        """The error a request admitted now gets (the engine is not ready, or it is dead)."""
        return self.error or EngineError("engine is not ready", 503, "service_unavailable")

    def start(self) -> None:
        """Watch the ranks for a death while idle (between steps nothing else would see it)."""
        ranks = self._ranks
        if ranks is None or self._watched:
            return
        self._loop = asyncio.get_running_loop()
        for fd in ranks.exit_fds:
            self._loop.add_reader(fd, self._on_rank_exit)
            self._watched.append(fd)

    def _on_rank_exit(self) -> None:
        ranks = self._ranks
        death = ranks.wait_dead(0) if ranks is not None else None
        self._stop_watching()  # a pidfd stays readable: one report is the news
        self.die(str(death or "a tensor-parallel rank exited"))

    async def step_failed(self, kind: str, requests: list[Request], error: Exception) -> None:
        """A ``kind`` step of ``requests`` raised ``error`` (logged with its traceback)."""
        logger.error("%s step failed for %d requests", kind, len(requests), exc_info=error)
        ranks = self._ranks
        if ranks is None and not isinstance(error, RankDied):
            for req in requests:  # a model error fails this batch, never the server
                self._fail(req, EngineError(f"model step failed: {error}", 500, "internal_error"))
            return
        death = None
        if ranks is not None and self.error is None:
            death = await asyncio.to_thread(ranks.wait_dead, DEATH_GRACE_S)
        self.die(str(death or error))

    def die(self, cause: str) -> None:
        """The engine can compute no more: fail what it holds, refuse the rest, tell once."""
        if self.error is not None:
            return
        msg = f"engine failed: {cause}"
        logger.error("%s: failing %d requests, refusing new ones", msg, len(self._requests))
        self.error = EngineError(msg, 503, "service_unavailable", "engine_failed")
        for req in list(self._requests.values()):
            self._fail(req, EngineError(msg, 500, "server_error", "engine_failed"))
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener(self.error)

    def _stop_watching(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for fd in self._watched:
                self._loop.remove_reader(fd)
        self._watched = []

    async def close(self) -> None:
        """Once no step runs any more: end the runner's rank processes (nothing at TP1)."""
        self._stop_watching()  # their exits now are the stop's, not a death
        await asyncio.to_thread(self._runner.close)
