"""Batching policy: prefill first (within a token budget), else one decode step for the running set.

The scheduler knows requests, pages and budgets only; KV hand-off between roles lives elsewhere.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.engine.request import Request, RequestState
from pdserve.kernels.kv_cache import PageAllocator


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running (decode) batch size limit
    max_prefill_tokens: int = 4096  # token budget of one prefill batch


class Batch(NamedTuple):
    kind: str  # "prefill" | "decode"
    requests: list[Request]


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator, page_size: int) -> None:
        self.config = config
        self.allocator = allocator
        self.page_size = page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        self.running.append(req)

    def remove(self, req: Request) -> None:
        """Forget a finished request wherever it is queued."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, *, decode: bool = True) -> Batch | None:
        return self._next_prefill() or (self._next_decode() if decode else None)

    def _pages_missing(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(req.seq.page_ids))

    def _next_prefill(self) -> Batch | None:
        batch: list[Request] = []
        budget = self.config.max_prefill_tokens
        while self.waiting and len(self.running) + len(batch) < self.config.max_num_seqs:
            req = self.waiting[0]
            num_new = req.seq.num_tokens - req.seq.num_cached_tokens
            if batch and num_new > budget:
                break
            missing = self._pages_missing(req, req.seq.num_tokens)
            if not self.allocator.can_allocate(missing):
                break
            req.seq.page_ids.extend(self.allocator.allocate(missing))
            budget -= num_new
            batch.append(self.waiting.popleft())
        return Batch("prefill", batch) if batch else None

    def _next_decode(self) -> Batch | None:
        # Each running sequence writes K/V of its last token this step: make room for it, preempting
        # the youngest sequences (recomputed later) when pages run out.
        i = 0
        while i < len(self.running):
            req = self.running[i]
            missing = self._pages_missing(req, req.seq.num_tokens)
            while not self.allocator.can_allocate(missing) and len(self.running) > i + 1:
                self._preempt(self.running.pop())
            if not self.allocator.can_allocate(missing):
                self._preempt(self.running.pop(i))
                continue
            req.seq.page_ids.extend(self.allocator.allocate(missing))
            i += 1
        return Batch("decode", list(self.running)) if self.running else None

    def _preempt(self, req: Request) -> None:
        self.allocator.free(req.seq.page_ids)
        req.seq.page_ids = []
        req.seq.num_cached_tokens = 0
        req.move(RequestState.WAITING, "preempted: out of KV pages")
        self.waiting.appendleft(req)
