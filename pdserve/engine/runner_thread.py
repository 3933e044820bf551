"""The one thread that runs model steps, with a lean hand-off to and from the event loop.

``loop.run_in_executor`` costs a concurrent future, its condition variable, a chained asyncio
future and two callbacks per call; a model step is submitted hundreds of times a second, so this
thread takes ``(fn, arg, future)`` from a ``SimpleQueue`` and hands the result back with a single
``call_soon_threadsafe``. The thread only computes: it never touches engine state.

It should also be the process's only thread that runs parallel torch work, model loading
included (:class:`pdserve.server.Server` loads the model on it). Each thread that enters an
OpenMP parallel region keeps its own team of pooled threads, and once a process holds more
OpenMP threads than cores, libgomp stops spinning between parallel regions: the step's
threads then sleep and wake at each of a forward's ~100 regions. Measured on the 2-core
machine, "small" decode steps at batch 8 took 28 ms with the model loaded on another thread
and 22-23 ms with everything on this one.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from pdserve.engine.cpu_lease import CpuLease

logger = logging.getLogger(__name__)

T = TypeVar("T")
_STOP = object()


class RunnerThread:
    """Runs submitted calls one at a time, in submission order, on a dedicated thread.

    ``lease``: each call runs holding it (workers that share the cores take turns); the thread
    owns it and closes it on :meth:`stop`.
    """

    def __init__(self, name: str = "pdserve-runner", lease: CpuLease | None = None) -> None:
        self.lease = lease
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._is_started = False
        self._is_stopped = False

    def submit(self, fn: Callable[[Any], T], arg: Any) -> asyncio.Future[T]:
        """Queue ``fn(arg)``; the returned future resolves on the calling loop."""
        if self._is_stopped:
            raise RuntimeError("runner thread is stopped")
        if not self._is_started:
            self._thread.start()
            self._is_started = True
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._jobs.put((fn, arg, fut, loop))
        return fut

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the queued calls, then end the thread (waits at most ``timeout_s``)."""
        if self._is_stopped:
            return
        self._is_stopped = True
        if self._is_started:
            self._jobs.put(_STOP)
            await asyncio.to_thread(self._thread.join, timeout_s)
            if self._thread.is_alive():
                logger.warning("runner thread still busy %.0fs after stop", timeout_s)
                return  # it may still hold the lease: leave it to the process's exit
        if self.lease is not None:
            await asyncio.to_thread(self.lease.close)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, arg, fut, loop = job
            try:
                if self.lease is not None:
                    self.lease.acquire()  # bounded; on timeout the step runs without it
                result, error = fn(arg), None
            except BaseException as exc:  # handed to the awaiting coroutine, which decides
                result, error = None, exc
            if self.lease is not None:
                self.lease.release()  # a no-op when it was not taken
            try:
                loop.call_soon_threadsafe(_resolve, fut, result, error)
            except RuntimeError:  # the loop closed while this step ran: nobody is waiting
                return


def _resolve(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
