"""Page frees that never hand a page out while something may still write it.

Two writers can still be at a page the engine has let go of: the forward in flight (the runner
thread may write a sequence's pages until the step ends) and the device (on CUDA a step's KV
writes may still be queued after the host moved on). So a free during a step waits for the
step's end, and a free after it waits for the last step's readiness marker
(:mod:`pdserve.kernels.kv_ready`; complete at once on a CPU). Only then do the pages go back to
the allocator, and ``on_freed`` tells the engine that pages are available.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pdserve.kernels.kv_cache import PageAllocator
from pdserve.kernels.kv_ready import ALWAYS_READY, KVReady, wait_kv_ready

logger = logging.getLogger(__name__)

_KV_READY_WARN_S = 30.0


class PageFrees:
    """The engine's one way to free pages (all calls on the event loop)."""

    def __init__(self, allocator: PageAllocator, on_freed: Callable[[], None]) -> None:
        self._allocator = allocator
        self._on_freed = on_freed
        self.is_stepping = False  # a forward is in flight: its pages may still be written
        self._deferred: list[int] = []
        self.waits: set[asyncio.Task[None]] = set()  # frees waiting on a step's marker
        self._last_kv_ready: KVReady = ALWAYS_READY  # the marker of the last step that ended

    def free(self, pages: list[int]) -> None:
        if self.is_stepping:
            self._deferred.extend(pages)
        elif not self._last_kv_ready.query():
            task = asyncio.get_running_loop().create_task(
                self._free_when_ready(self._last_kv_ready, pages), name="pdserve-free-when-ready"
            )
            self.waits.add(task)
            task.add_done_callback(self.waits.discard)
        else:
            self._allocator.free(pages)
            self._on_freed()

    def begin_step(self) -> None:
        self.is_stepping = True

    def end_step(self, kv_ready: KVReady) -> None:
        """At a step's end: free what it deferred, once ``kv_ready`` (the step's marker) is."""
        self.is_stepping = False
        self._last_kv_ready = kv_ready
        if self._deferred:
            pages, self._deferred = self._deferred, []
            self.free(pages)

    async def _free_when_ready(self, kv_ready: KVReady, pages: list[int]) -> None:
        while not await wait_kv_ready(kv_ready, _KV_READY_WARN_S):
            logger.error(
                "%d freed KV pages still wait for a step's device writes after %.0fs (device "
                "hung?); they stay held", len(pages), _KV_READY_WARN_S,
            )  # fmt: skip
        self.free(pages)
