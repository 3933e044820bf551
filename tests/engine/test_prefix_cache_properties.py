"""Property tests of scheduler + prefix cache + page allocator under any sequence of events.

A shadow model records which tokens each page's KV was computed for. Steps are applied as the
engine applies them; requests are admitted, finished, aborted mid-prefill, preempted by page
pressure, and cached pages are evicted when the small pool runs out. After every event: no page
is freed while referenced, no page is written while shared or keyed, a reused page holds exactly
the tokens the reader expects, and every page is accounted for (free + cached + referenced).
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.engine.request import Request, RequestState
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.kernels.kv_cache import PageAllocator
from pdserve.sequence import Sequence

PAGE = 4
NUM_PAGES = 24
# Prompts are drawn from a few shared prefixes plus a tail, so pages are shared often.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 12]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES)
        self.sched: Scheduler | None = None
        self.content: dict[int, list[int]] = {}  # page -> tokens its KV was computed for
        self.live: dict[str, Request] = {}
        self.n = 0

    @rule(chunked=st.booleans(), budget=st.integers(2, 24), caching=st.booleans())
    @precondition(lambda self: self.sched is None)
    def configure(self, chunked: bool, budget: int, caching: bool) -> None:
        cfg = SchedulerConfig(
            max_num_seqs=4, max_prefill_tokens=budget, chunked_prefill=chunked,
            prefix_caching=caching,
        )  # fmt: skip
        self.sched = Scheduler(cfg, self.alloc, PAGE)

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(1, 12), tail=st.lists(
        st.integers(20, 23), max_size=6), max_tokens=st.integers(1, 6))  # fmt: skip
    @precondition(lambda self: self.sched is not None and len(self.live) < 6)
    def add(self, prefix: list[int], cut: int, tail: list[int], max_tokens: int) -> None:
        ids = prefix[:cut] + tail
        rid = f"r{self.n}"
        self.n += 1
        req = Request(rid, Sequence(rid, ids, len(ids)))
        req.seq.sampling.max_tokens = max_tokens
        self.live[rid] = req
        self.sched.add(req)

    @rule()
    @precondition(lambda self: self.sched is not None and self.sched.has_work())
    def step(self) -> None:
        batch = self.sched.schedule()
        if batch is None:
            return
        for req, end in zip(batch.prefill, batch.prefill_ends, strict=True):
            assert end > req.seq.num_cached_tokens, "a prefill row computes at least one token"
            self._write(req, end)
        for req in batch.decode:
            self._write(req, req.seq.num_tokens)
        for req in batch.decode:
            req.seq.num_cached_tokens = req.seq.num_tokens
            req.seq.token_ids.append(30 + req.seq.num_generated % 3)
            if req.seq.num_generated >= req.seq.sampling.max_tokens:
                self._finish(req)
        for req, end in zip(batch.prefill, batch.prefill_ends, strict=True):
            if self.sched.prefilled(req, end):
                req.seq.token_ids.append(30)
                req.move(RequestState.RUNNING, "prefilled")
                self.sched.add_running(req)

    def _write(self, req: Request, end: int) -> None:
        """The forward writes K/V of positions [num_cached, end): never into a shared page."""
        seq = req.seq
        assert end <= len(seq.page_ids) * PAGE
        for pos in range(seq.num_cached_tokens, end):
            page = seq.page_ids[pos // PAGE]
            assert self.alloc.refcount(page) == 1, f"write into shared page {page}"
            assert not self.alloc.is_keyed(page), f"write into cached page {page}"
            tokens = self.content.setdefault(page, [])
            del tokens[pos % PAGE :]
            tokens.append(seq.token_ids[pos])

    @rule(data=st.data())
    @precondition(lambda self: self.sched is not None and self.live)
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self._finish(self.live[rid])

    def _finish(self, req: Request) -> None:
        self.sched.remove(req)
        req.move(RequestState.FINISHED, "done")
        if req.seq.page_ids:
            self.alloc.free(self.sched.release_pages(req))
        req.seq.page_ids = []
        del self.live[req.request_id]

    @invariant()
    def reused_pages_hold_the_readers_tokens(self) -> None:
        for req in self.live.values():
            seq = req.seq
            for i in range(seq.num_cached_tokens // PAGE):
                page = seq.page_ids[i]
                assert self.content.get(page) == seq.token_ids[i * PAGE : (i + 1) * PAGE]

    @invariant()
    def every_page_is_accounted_for(self) -> None:
        self.alloc.check_integrity()
        refs = [0] * NUM_PAGES
        for req in self.live.values():
            for p in req.seq.page_ids:
                refs[p] += 1
        assert refs == [self.alloc.refcount(p) for p in range(NUM_PAGES)]
        a = self.alloc
        assert a.num_free + a.num_cached + a.num_used == NUM_PAGES
        if not self.live:
            assert a.num_used == 0


TestSchedulerWithPrefixCache = SchedulerMachine.TestCase
TestSchedulerWithPrefixCache.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
