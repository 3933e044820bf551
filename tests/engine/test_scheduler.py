from __future__ import annotations

from pdserve.engine.request import Request, RequestState
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.kernels.kv_cache import PageAllocator
from pdserve.sequence import Sequence

PAGE = 4


def make_req(rid: str, num_prompt: int) -> Request:
    return Request(rid, Sequence(rid, list(range(num_prompt)), num_prompt))


def make_scheduler(num_pages: int = 16, **kw: int) -> Scheduler:
    return Scheduler(SchedulerConfig(**kw), PageAllocator(num_pages), PAGE)


def test_prefill_batch_respects_token_budget_but_always_takes_one():
    s = make_scheduler(max_prefill_tokens=10)
    for rid, n in [("a", 12), ("b", 4), ("c", 4)]:
        s.add(make_req(rid, n))
    first = s.schedule()
    assert first.kind == "prefill" and [r.request_id for r in first.requests] == ["a"]
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
    assert [r.request_id for r in s.schedule().requests] == ["a"]
    assert s.schedule(decode=False) is None  # "b" waits for pages
    assert len(s.waiting) == 1


def test_decode_grows_pages_at_page_boundary():
    s = make_scheduler()
    req = make_req("a", PAGE)
    s.add(req)
    s.schedule()
    req.seq.num_cached_tokens = PAGE
    req.seq.token_ids.append(7)  # 5th token needs a second page
    req.move(RequestState.RUNNING, "test")
    s.add_running(req)
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
        req.seq.num_cached_tokens = PAGE
        req.seq.token_ids.append(1)
        req.move(RequestState.RUNNING, "test")
        s.add_running(req)
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
