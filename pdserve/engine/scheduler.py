"""Batching policy: which requests compute which tokens in the next step, within budgets.

Chunked (the default): every step runs one decode row per running request plus prompt chunks
of waiting or partly prefilled requests, together within ``max_prefill_tokens`` tokens (a decode
row counts one), so running streams go on producing tokens while a long prompt is prefilled.
Unchunked: a step is either a prefill batch of whole prompts (prefill first) or a decode step.

A request's pages are all allocated when its prefill starts (cached prefix pages shared, by
reference, through :class:`~pdserve.engine.prefix_cache.PrefixCache`), so a partly prefilled
request can always finish. The scheduler knows requests, pages and budgets only; KV hand-off
between roles lives elsewhere.

Policies (vLLM's ``--scheduling-policy``): ``fcfs`` runs requests in arrival order; ``priority``
keeps its queues in (``priority``, arrival) order, lower values first, and lets the head of the
waiting queue take the row and pages of running requests of a lower priority (larger value)
when it could not start otherwise. A preempted request keeps its tokens; its re-prefill over
prompt and generated tokens gives the same K/V bits (batch-invariant kernels) and its sampler
the same noise (a function of seed and position), so it continues exactly.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.request import Request, RequestState
from pdserve.kernels.kv_cache import PageAllocator
from pdserve.kernels.prompt_logprobs import wants_prompt_logprobs
from pdserve.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running (decode) batch size limit
    # Tokens computed per step: prompt chunks plus one per decode row (chunked), or the budget
    # of one whole-prompt prefill batch (unchunked; a longer prompt still runs, alone).
    max_prefill_tokens: int = 2048
    chunked_prefill: bool = True
    prefix_caching: bool = True
    policy: str = "fcfs"  # or "priority" (SCHEDULING_POLICIES)

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}"
            )


SCHEDULING_POLICIES = ("fcfs", "priority")


def priority_key(req: Request) -> tuple[int, float]:
    """Lower runs first: the request's priority value, then its arrival."""
    return (req.priority, req.arrival)


def insert_by_priority(queue: deque[Request] | list[Request], req: Request) -> None:
    """Put ``req`` into ``queue`` (in :func:`priority_key` order) after every equal key."""
    i, key = len(queue), priority_key(req)
    while i > 0 and priority_key(queue[i - 1]) > key:
        i -= 1
    queue.insert(i, req)


@dataclass
class SchedulerStats:
    """Counters the metrics module reads: preemptions by cause."""

    num_preemptions: dict[str, int] = field(
        default_factory=lambda: {"out_of_pages": 0, "priority": 0}
    )


class Batch(NamedTuple):
    """One step: decode rows, and prefill rows each computing up to ``prefill_ends[i]`` tokens."""

    decode: list[Request]
    prefill: list[Request]
    prefill_ends: list[int]

    @property
    def kind(self) -> str:
        return "mixed" if self.decode and self.prefill else "decode" if self.decode else "prefill"

    @property
    def requests(self) -> list[Request]:
        return self.decode + self.prefill

    def num_prefill_tokens(self) -> int:
        """Prompt tokens the step computes (before it ran)."""
        ends = zip(self.prefill, self.prefill_ends, strict=True)
        return sum(end - r.seq.num_cached_tokens for r, end in ends)

    def prefill_seqs(self) -> list[Sequence]:
        """What the runner prefills: the sequence itself for a last chunk, else a view that ends
        where the chunk ends (its sampled token is discarded)."""
        out = []
        for req, end in zip(self.prefill, self.prefill_ends, strict=True):
            s = req.seq
            if end == s.num_tokens:
                out.append(s)
            else:
                out.append(
                    Sequence(s.seq_id, s.token_ids[:end], min(s.num_prompt_tokens, end),
                             s.sampling, s.page_ids, s.num_cached_tokens)
                )  # fmt: skip
        return out


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: PageAllocator,
        page_size: int,
        cache: PrefixCache | None = None,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.page_size = page_size
        self.cache = cache or PrefixCache(allocator, page_size, enabled=config.prefix_caching)
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # pages allocated, prompt partly computed
        self.running: list[Request] = []
        # Decode role: KV received while max_num_seqs run; they join as rows free up.
        self.ready: deque[Request] = deque()
        self.is_priority = config.policy == "priority"
        self.stats = SchedulerStats()

    def add(self, req: Request) -> None:
        self._enqueue(self.waiting, req, at_head=False)

    def _enqueue(
        self, queue: deque[Request] | list[Request], req: Request, *, at_head: bool
    ) -> None:
        """fcfs: at the tail (or the head: a preempted request); priority: in key order."""
        if not self.is_priority:
            if at_head:
                assert isinstance(queue, deque)
                queue.appendleft(req)
            else:
                queue.append(req)
            return
        insert_by_priority(queue, req)

    def add_running(self, req: Request) -> None:
        """A request with its prompt's KV computed or received joins the decode batch, or waits
        in ``ready`` (pages held, first token out) while ``max_num_seqs`` requests run."""
        if self._num_seqs() < self.config.max_num_seqs:
            self._enqueue(self.running, req, at_head=False)
        else:
            self._enqueue(self.ready, req, at_head=False)

    def _num_seqs(self) -> int:
        return len(self.running) + len(self.prefilling)

    def remove(self, req: Request) -> None:
        """Forget a finished request wherever it is queued."""
        for queue in (self.running, self.prefilling, self.waiting, self.ready):
            if req in queue:
                queue.remove(req)
                return

    def num_prompt_tokens_queued(self) -> int:
        """Prompt tokens still to prefill (waiting requests whole, the rest of partly prefilled
        ones): the backlog a router's admission check weighs against a new prompt."""
        waiting = sum(r.seq.num_tokens for r in self.waiting)
        return waiting + sum(r.seq.num_tokens - r.seq.num_cached_tokens for r in self.prefilling)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.ready)

    def schedule(self, *, decode: bool = True) -> Batch | None:
        if self.is_priority and self.waiting and self.running:
            self._preempt_for_priority()  # before the decode rows are taken
        if not self.config.chunked_prefill:
            prefill, ends = self._next_prefill(self.config.max_prefill_tokens, whole=True)
            if prefill:
                return Batch([], prefill, ends)
            rows = self._next_decode() if decode else []
            return Batch(rows, [], []) if rows else None
        rows = self._next_decode() if decode else []
        # A page of prompt per step at least, however many decode rows there are.
        budget = max(self.config.max_prefill_tokens - len(rows), self.page_size)
        prefill, ends = self._next_prefill(budget, whole=False)
        return Batch(rows, prefill, ends) if rows or prefill else None

    # ---- results -----------------------------------------------------------------------------
    def prefilled(self, req: Request, end: int) -> bool:
        """A prefill row's K/V up to ``end`` is written; True when that was its last chunk."""
        seq = req.seq
        seq.num_cached_tokens = end
        self.cache.register(seq, req.page_keys)
        if end < seq.num_tokens:
            return False
        if req in self.prefilling:
            self.prefilling.remove(req)
        return True

    def release_pages(self, req: Request) -> list[int]:
        """Register a request's computed pages in the cache; its pages, for the caller to free."""
        self.cache.register(req.seq, req.page_keys)
        return req.seq.page_ids

    # ---- policy ------------------------------------------------------------------------------
    def _pages_missing(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(req.seq.page_ids))

    def _next_prefill(self, budget: int, *, whole: bool) -> tuple[list[Request], list[int]]:
        batch: list[Request] = []
        ends: list[int] = []
        for req in self.prefilling:  # partly prefilled ones go on first, oldest first
            if budget <= 0:
                break
            take = min(req.seq.num_tokens - req.seq.num_cached_tokens, budget)
            batch.append(req)
            ends.append(req.seq.num_cached_tokens + take)
            budget -= take
        while (
            self.waiting
            and (budget > 0 or (whole and not batch))
            and self._num_seqs() < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            seq = req.seq
            # Prompt logprobs come from one forward over the whole prompt: no cached prefix
            # (its positions would have no entries) and no chunks (vLLM skips the cache too).
            one_forward = whole or wants_prompt_logprobs(seq)
            hit = [] if wants_prompt_logprobs(seq) else self.cache.lookup(seq, req.page_keys)
            num_new = seq.num_tokens - len(hit) * self.page_size
            if one_forward and batch and num_new > budget:
                break
            missing = -(-seq.num_tokens // self.page_size) - len(hit)
            if not self.cache.can_allocate_with(hit, missing):
                break
            self.waiting.popleft()
            self.cache.acquire(seq, hit)
            seq.page_ids.extend(self.allocator.allocate(missing))
            if req.num_cached_prompt_tokens is None:  # the first prefill is what clients see
                req.num_cached_prompt_tokens = seq.num_cached_tokens
            logger.debug(
                "req=%s prefill starts: %d of %d tokens cached, %d pages shared",
                req.request_id, seq.num_cached_tokens, seq.num_tokens, len(hit),
            )  # fmt: skip
            take = num_new if one_forward else min(num_new, budget)
            req.move(RequestState.PREFILLING, "prefill starts")
            self.prefilling.append(req)
            batch.append(req)
            ends.append(seq.num_cached_tokens + take)
            budget -= take
        return batch, ends

    def _next_decode(self) -> list[Request]:
        # Received requests take free rows, after the preempted ones waiting for a re-prefill;
        # with nothing running one goes anyway (the waiting may need the pages it holds).
        while self.ready and (
            self._num_seqs() + len(self.waiting) < self.config.max_num_seqs
            or not (self.running or self.prefilling)
        ):
            self._enqueue(self.running, self.ready.popleft(), at_head=False)
        # Each running sequence writes K/V of its last token this step: make room for it, preempting
        # the youngest sequences (recomputed later) when pages run out; under the priority
        # policy ``running`` is in key order, so the last is the lowest priority's youngest.
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
        return list(self.running)

    def _preempt_for_priority(self) -> None:
        """The head of the waiting queue takes the row and pages of running requests of lower
        priority, lowest (then youngest) first, when it could not start otherwise; none is
        preempted unless that lets it start."""
        head, cfg = self.waiting[0], self.config
        victims = [r for r in self.running if priority_key(r) > priority_key(head)]
        if not victims:
            return
        seq = head.seq
        hit = [] if wants_prompt_logprobs(seq) else self.cache.lookup(seq, head.page_keys)
        missing = -(-seq.num_tokens // self.page_size) - len(hit)

        def is_blocked() -> bool:
            no_row = self._num_seqs() >= cfg.max_num_seqs
            return no_row or not self.cache.can_allocate_with(hit, missing)

        # At most every victim's pages come back (fewer where others share them).
        freeable = sum(len(v.seq.page_ids) for v in victims)
        reviving = sum(1 for p in hit if self.allocator.refcount(p) == 0)
        if not is_blocked() or self.allocator.num_available + freeable < missing + reviving:
            return
        while victims and is_blocked():
            victim = victims.pop()  # running is in key order: the lowest priority's youngest
            self.running.remove(victim)
            self._preempt(victim, "priority")

    def _preempt(self, req: Request, cause: str = "out_of_pages") -> None:
        # Its computed full pages stay cached: the re-prefill finds most of them again.
        self.allocator.free(self.release_pages(req))
        req.seq.page_ids = []
        req.seq.num_cached_tokens = 0
        why = "out of KV pages" if cause == "out_of_pages" else "a request of higher priority"
        req.move(RequestState.WAITING, f"preempted: {why}")
        self.stats.num_preemptions[cause] += 1
        self._enqueue(self.waiting, req, at_head=True)
