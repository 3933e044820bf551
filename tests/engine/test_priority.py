"""--scheduling-policy priority: lower ``priority`` values are admitted first (ties by arrival),
and a waiting request may take the row of a running one of lower priority; fcfs ignores it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.protocol import GenerateRequest
from pdserve.engine.request import Request, RequestState
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.stats import EngineObserver
from pdserve.kernels.kv_cache import PageAllocator
from pdserve.model_runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence
from tests.engine.test_engine import assert_idle

NUM_QUEUED = 20


class FirstTokens(EngineObserver):
    """Records the order of first tokens, and which requests were still waiting (not yet
    prefilling) when the one named ``watch`` arrived."""

    def __init__(self, watch: str) -> None:
        self.watch = watch
        self.order: list[str] = []
        self.waiting_at_arrival: set[str] = set()
        self.engine: Engine | None = None

    def on_arrival(self, req: Request) -> None:
        if req.request_id == self.watch and self.engine is not None:
            live = self.engine.debug_requests()
            waiting = {r["request_id"] for r in live if r["state"] == "waiting"}
            self.waiting_at_arrival = waiting - {self.watch}

    def on_first_token(self, req: Request, ttft_s: float) -> None:
        self.order.append(req.request_id)


async def _drain(engine: Engine, request: GenerateRequest) -> int:
    return sum([len(o.token_ids) async for o in engine.generate(request)])


async def _run_full_queue(runner: ModelRunner, policy: str) -> FirstTokens:
    """Two rows, both taken, NUM_QUEUED priority-10 requests queued; then one of priority 0."""
    observer = FirstTokens(watch="urgent")
    sched = SchedulerConfig(max_num_seqs=2, policy=policy)
    engine = Engine(EngineConfig(scheduler=sched), runner, incarnation="t", observer=observer)
    observer.engine = engine
    await engine.start()
    try:
        sp: dict[str, Any] = dict(max_tokens=24, temperature=0, ignore_eos=True)
        queued = [
            asyncio.create_task(
                _drain(
                    engine,
                    GenerateRequest(f"q{i}", [3 + i, 4, 5], SamplingParams(**sp), priority=10),
                )  # fmt: skip
            )
            for i in range(NUM_QUEUED)
        ]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30.0
        while len(observer.order) < 2:  # both rows taken: the rest waits
            assert loop.time() < deadline, "nothing started"
            await asyncio.sleep(0.002)  # poll with a deadline
        urgent = GenerateRequest("urgent", [9, 9, 9], SamplingParams(**sp), priority=0)
        assert await asyncio.wait_for(_drain(engine, urgent), 60.0) == 24
        assert await asyncio.wait_for(asyncio.gather(*queued), 60.0) == [24] * NUM_QUEUED
        await assert_idle(engine)
        return observer
    finally:
        await engine.stop()


async def test_a_priority_0_request_starts_before_every_queued_priority_10_one(
    runner: ModelRunner,
):
    seen = await _run_full_queue(runner, "priority")
    assert len(seen.waiting_at_arrival) >= NUM_QUEUED // 2, "the queue was full when it came"
    after = seen.order[seen.order.index("urgent") + 1 :]
    assert seen.waiting_at_arrival <= set(after)  # admitted before every one still waiting


async def test_fcfs_serves_the_same_priority_0_request_after_the_queue(runner: ModelRunner):
    seen = await _run_full_queue(runner, "fcfs")
    assert len(seen.waiting_at_arrival) >= NUM_QUEUED // 2
    before = seen.order[: seen.order.index("urgent")]
    assert seen.waiting_at_arrival <= set(before)


def _req(rid: str, priority: int, arrival: float) -> Request:
    req = Request(rid, Sequence(rid, [1, 2, 3], 3), priority=priority)
    req.arrival = arrival
    return req


def test_the_priority_queue_orders_by_value_then_arrival():
    s = Scheduler(SchedulerConfig(policy="priority"), PageAllocator(16), 4)
    for rid, prio, at in [("a", 5, 1.0), ("b", 0, 2.0), ("c", 5, 0.5), ("d", -3, 3.0)]:
        s.add(_req(rid, prio, at))
    assert [r.request_id for r in s.waiting] == ["d", "b", "c", "a"]
    fcfs = Scheduler(SchedulerConfig(), PageAllocator(16), 4)
    for rid, prio, at in [("a", 5, 1.0), ("b", 0, 2.0)]:
        fcfs.add(_req(rid, prio, at))
    assert [r.request_id for r in fcfs.waiting] == ["a", "b"]


def test_an_unknown_scheduling_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling policy"):
        SchedulerConfig(policy="lifo")


def _running(s: Scheduler, req: Request) -> None:
    """Through its prefill into the decode batch, as the engine does."""
    s.add(req)
    batch = s.schedule()
    assert batch is not None and req in batch.prefill
    assert s.prefilled(req, req.seq.num_tokens)
    req.seq.token_ids.append(1)
    req.move(RequestState.RUNNING, "prefilled")
    s.add_running(req)


def test_a_lower_priority_stream_is_preempted_only_when_that_lets_the_head_start():
    s = Scheduler(SchedulerConfig(policy="priority", prefix_caching=False), PageAllocator(4), 4)
    low = Request("low", Sequence("low", list(range(7)), 7), priority=10)
    _running(s, low)  # 2 pages of 4
    huge = Request("huge", Sequence("huge", list(range(20)), 20), priority=0)  # 5 pages
    s.add(huge)
    batch = s.schedule()
    assert batch is not None and batch.decode == [low]  # preempting it would not be enough
    assert s.stats.num_preemptions["priority"] == 0
    s.remove(huge)
    high = Request("high", Sequence("high", list(range(12)), 12), priority=0)  # 3 pages
    s.add(high)
    batch = s.schedule()
    assert batch is not None and batch.prefill == [high] and batch.decode == []
    assert low.state is RequestState.WAITING and low.seq.page_ids == []
    assert low.seq.token_ids == [*range(7), 1]  # its tokens kept for the re-prefill
    assert s.stats.num_preemptions == {"out_of_pages": 0, "priority": 1}
    s.allocator.check_integrity()
