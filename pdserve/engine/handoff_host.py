"""What a hand-off (:mod:`pdserve.engine.handoff`) may use of the engine it is attached to.

A narrow view, so that the hand-off reads on its own and never imports the engine: the pages and
the queue it lends from and to, deadlines, and the calls that move a request on or end it.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.engine.config import EngineConfig
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.protocol import EngineError, TokenLogprob
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler
from pdserve.kernels.kv_cache import PageAllocator
from pdserve.model_runner import ModelRunner


class HandoffHost(Protocol):
    """The engine, as its hand-off sees it (:class:`~pdserve.engine.engine.Engine` is one)."""

    config: EngineConfig
    runner: ModelRunner  # its KV page geometry (``kv_config``)
    allocator: PageAllocator
    prefix_cache: PrefixCache
    scheduler: Scheduler

    def enqueue_prefill(self, req: Request) -> None: ...

    def start_decoding(
        self, req: Request, first_token: int, logprob: TokenLogprob | None = None
    ) -> None: ...

    def finish_with(self, req: Request, ids: list[int], finish_reason: str) -> None: ...

    def fail(self, req: Request, error: EngineError) -> None: ...

    def free_pages(self, pages: list[int]) -> None: ...

    def arm(self, req: Request, seconds: float, label: str) -> None: ...
