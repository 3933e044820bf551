from __future__ import annotations

from pdserve.engine.request import Request, RequestState
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.kernels.kv_cache import PageAllocator
from pdserve.sequence import Sequence

PAGE = 4


def make_req(rid: str, num_prompt: int) -> Request:
    return Request(rid, Sequence(rid, list(range(num_prompt)), num_prompt))


def make_scheduler(num_pages: int = 16, **kw: object) -> Scheduler:
    kw.setdefault("chunked_prefill", False)
    return Scheduler(SchedulerConfig(**kw), PageAllocator(num_pages), PAGE)


def prefilled(s: Scheduler, req: Request, token: int = 1) -> None:
    """What the engine does with a finished prefill: K/V written, token sampled, running."""
    assert s.prefilled(req, req.seq.num_tokens)
    req.seq.token_ids.append(token)
    req.move(RequestState.RUNNING, "test")
    s.add_running(req)


def test_prefill_batch_respects_token_budget_but_always_takes_one():
    s = make_scheduler(max_prefill_tokens=10)
    for rid, n in [("a", 12), ("b", 4), ("c", 4)]:
        s.add(make_req(rid, n))
    first = s.schedule()
    assert first.kind == "prefill" and [r.request_id for r in first.requests] == ["a"]
    assert s.prefilled(first.prefill[0], first.prefill_ends[0])
    second = s.schedule(decode=False)
    assert [r.request_id for r in second.requests] == ["b", "c"]


def test_prefill_allocates_pages_for_all_prompt_tokens():
    s = make_scheduler()
    req = make_req("a", PAGE + 1)
    s.add(req)
    s.schedule()
    assert len(req.seq.page_ids) == 2
    assert s.allocator.num_free == 14


def test_prefill_waits_when_pages_run_out():
    s = make_scheduler(num_pages=2)
    s.add(make_req("a", 2 * PAGE))
    s.add(make_req("b", 1))
    first = s.schedule()
    assert [r.request_id for r in first.requests] == ["a"]
    assert s.prefilled(first.prefill[0], first.prefill_ends[0])
    assert s.schedule(decode=False) is None  # "b" waits for pages
    assert len(s.waiting) == 1


def test_decode_grows_pages_at_page_boundary():
    s = make_scheduler()
    req = make_req("a", PAGE)
    s.add(req)
    s.schedule()
    prefilled(s, req, 7)  # 5th token needs a second page
    batch = s.schedule()
    assert batch.kind == "decode" and batch.requests == [req]
    assert len(req.seq.page_ids) == 2


def test_decode_preempts_youngest_when_out_of_pages():
    s = make_scheduler(num_pages=2)
    old, young = make_req("old", PAGE), make_req("young", PAGE)
    for req in (old, young):
        s.add(req)
    s.schedule()
    for req in (old, young):
        prefilled(s, req)
    batch = s.schedule()
    assert batch.requests == [old]
    assert young.state is RequestState.WAITING and young.seq.page_ids == []
    assert young.seq.num_cached_tokens == 0 and s.waiting[0] is young
    s.allocator.check_integrity()


def test_max_num_seqs_bounds_running_plus_prefill():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add(make_req(str(i), 1))
    assert len(s.schedule().requests) == 2
    assert len(s.waiting) == 1


def test_decode_request_lifecycle_passes_through_waiting_for_kv():
    req = make_req("d", 3)
    assert req.move(RequestState.WAITING_FOR_KV, "admitted")
    assert req.last_transition == ("waiting", "waiting_for_kv", "admitted")
    assert req.move(RequestState.RUNNING, "kv received")
    assert req.move(RequestState.FINISHED, "done")
    assert not req.move(RequestState.RUNNING, "late event")  # FINISHED is absorbing
    assert req.state is RequestState.FINISHED


def chunked_scheduler(num_pages: int = 32, **kw: object) -> Scheduler:
    return make_scheduler(num_pages, chunked_prefill=True, **kw)


def test_long_prompt_is_prefilled_in_chunks_while_running_rows_decode():
    s = chunked_scheduler(max_prefill_tokens=8)
    short = make_req("short", 2)
    s.add(short)
    first = s.schedule()
    prefilled(s, short)
    long = make_req("long", 20)
    s.add(long)
    ends = []
    while long.state is not RequestState.RUNNING:
        batch = s.schedule()
        assert batch.decode == [short]  # the stream goes on every step
        assert (
            len(batch.decode) + sum(e - long.seq.num_cached_tokens for e in batch.prefill_ends) <= 8
        )
        ends.append(batch.prefill_ends[0])
        short.seq.num_cached_tokens = short.seq.num_tokens
        short.seq.token_ids.append(1)
        if s.prefilled(long, batch.prefill_ends[0]):
            long.move(RequestState.RUNNING, "test")
    assert first.prefill == [short] and ends == [7, 14, 20]
    assert len(long.seq.page_ids) == 5  # all its pages from the first chunk on


def test_chunk_view_ends_at_the_chunk_and_shares_the_pages():
    s = chunked_scheduler(max_prefill_tokens=6)
    req = make_req("a", 10)
    s.add(req)
    batch = s.schedule()
    [view] = batch.prefill_seqs()
    assert view is not req.seq and view.token_ids == list(range(6))
    assert view.page_ids is req.seq.page_ids and view.num_cached_tokens == 0


def test_second_request_reuses_the_full_pages_of_a_shared_prefix():
    s = chunked_scheduler()
    a = make_req("a", 10)  # pages: [0..3], [4..7] full, [8, 9] partial
    s.add(a)
    s.schedule()
    prefilled(s, a)
    b = Request("b", Sequence("b", list(range(8)) + [50, 51, 52], 11))
    s.add(b)
    batch = s.schedule()
    assert batch.prefill == [b] and b.seq.num_cached_tokens == 8
    assert b.seq.page_ids[:2] == a.seq.page_ids[:2] and b.seq.page_ids[2] != a.seq.page_ids[2]
    assert [s.allocator.refcount(p) for p in b.seq.page_ids] == [2, 2, 1]
    assert b.num_cached_prompt_tokens == 8
    stats = s.cache.stats
    assert (stats.query_tokens, stats.hit_tokens) == (21, 8)


def test_fully_cached_prompt_recomputes_its_last_page_in_a_page_of_its_own():
    s = chunked_scheduler()
    a = make_req("a", 8)
    s.add(a)
    s.schedule()
    prefilled(s, a)
    b = make_req("b", 8)
    s.add(b)
    s.schedule()
    assert b.seq.num_cached_tokens == 4 and b.seq.page_ids[0] == a.seq.page_ids[0]
    assert b.seq.page_ids[1] != a.seq.page_ids[1]


def test_released_pages_stay_cached_for_the_next_request_and_count_apart_from_free():
    s = chunked_scheduler(num_pages=4)
    a = make_req("a", 9)
    s.add(a)
    s.schedule()
    prefilled(s, a)
    s.remove(a)
    s.allocator.free(s.release_pages(a))
    alloc = s.allocator
    assert (alloc.num_free, alloc.num_cached, alloc.num_used) == (2, 2, 0)  # 2 full pages
    b = make_req("b", 9)
    s.add(b)
    s.schedule()
    assert b.seq.num_cached_tokens == 8 and alloc.num_used == 3


def test_no_prefix_caching_computes_every_prompt_from_scratch():
    s = chunked_scheduler(prefix_caching=False)
    a = make_req("a", 9)
    s.add(a)
    s.schedule()
    prefilled(s, a)
    b = make_req("b", 9)
    s.add(b)
    s.schedule()
    assert b.seq.num_cached_tokens == 0 and not set(a.seq.page_ids) & set(b.seq.page_ids)


def received(s: Scheduler, rid: str) -> Request:
    """A decode-role request whose prompt KV arrived with its first token."""
    req = make_req(rid, 3)
    req.seq.page_ids = s.allocator.allocate(1)
    req.seq.num_cached_tokens = 3
    req.seq.token_ids.append(9)
    return req


def test_received_requests_beyond_max_num_seqs_wait_ready_and_join_as_rows_free():
    """Decode role: add_running is bounded by max_num_seqs too; the excess keeps its pages and
    joins in arrival order once a running request ends."""
    s = make_scheduler(max_num_seqs=2)
    reqs = [received(s, f"r{i}") for i in range(3)]
    for req in reqs:
        s.add_running(req)
    assert [r.request_id for r in s.schedule().decode] == ["r0", "r1"]
    assert list(s.ready) == [reqs[2]] and s.has_work()
    s.remove(reqs[0])
    assert [r.request_id for r in s.schedule().decode] == ["r1", "r2"]
    assert not s.ready


def test_a_preempted_request_gets_the_free_row_before_a_received_one():
    s = make_scheduler(max_num_seqs=2, chunked_prefill=True)
    running, late = received(s, "running"), received(s, "late")
    s.add_running(running)
    preempted = make_req("old", 3)
    s.add(preempted)  # as _preempt leaves it: waiting for a re-prefill
    s.ready.append(late)
    batch = s.schedule()
    assert batch.prefill == [preempted] and batch.decode == [running]
    assert list(s.ready) == [late]
    prefilled(s, preempted)
    s.remove(running)
    assert [r.request_id for r in s.schedule().decode] == ["old", "late"]


def test_with_nothing_running_a_ready_request_runs_so_its_pages_come_back():
    s = make_scheduler(num_pages=1, max_num_seqs=1)
    late = received(s, "late")  # holds the only page
    s.ready.append(late)
    s.add(make_req("old", 3))  # needs that page for its re-prefill
    assert s.schedule().decode == [late]


def test_the_prompt_tokens_still_to_prefill_are_the_backlog_a_router_weighs():
    s = chunked_scheduler(max_prefill_tokens=8)
    assert s.num_prompt_tokens_queued() == 0
    long, short = make_req("long", 20), make_req("short", 3)
    s.add(long)
    s.add(short)
    assert s.num_prompt_tokens_queued() == 23
    batch = s.schedule()  # the first 8 tokens of the long prompt
    assert s.prefilled(long, batch.prefill_ends[0]) is False
    assert s.num_prompt_tokens_queued() == 12 + 3
    while s.num_prompt_tokens_queued():
        batch = s.schedule()
        for req, end in zip(batch.prefill, batch.prefill_ends, strict=True):
            if s.prefilled(req, end):
                req.move(RequestState.RUNNING, "test")
    assert long.state is short.state is RequestState.RUNNING
