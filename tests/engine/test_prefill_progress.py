"""A prompt being prefilled is making progress, not waiting: its deadline follows the engine's
prefill steps, so a long prefill completes and only one that stops moving times out; a prompt
too long for the request's deadline at the measured prefill rate is refused up front."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from pdserve.engine.config import RequestDeadlines
from pdserve.engine.engine import Engine
from pdserve.engine.protocol import EngineError, GenerateRequest
from pdserve.engine.scheduler import SchedulerConfig
from pdserve.model_runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from tests.engine.test_engine import assert_idle, collect, started

CHUNK = 16  # the runner fixture's page size: the smallest chunk budget
STEP_S = 0.1  # a slowed prefill step


def slow_prefill(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, before: Callable[[int], None]
) -> list[float]:
    """Every step of ``engine`` with prompt chunks first calls ``before(step number)`` on the
    runner thread: the slowed or stuck worker of these tests. Returns those steps' durations."""
    durations: list[float] = []
    run = engine.steps.run

    def slowed(seqs: tuple[list[Any], list[Any]]) -> Any:
        if not seqs[1]:  # decode rows only
            return run(seqs)
        started_at = time.monotonic()
        before(len(durations))
        out = run(seqs)
        durations.append(time.monotonic() - started_at)
        return out

    monkeypatch.setattr(engine.steps, "run", slowed)
    return durations


def engine_config(waiting_s: float, progress_s: float, **deadlines: Any) -> dict[str, Any]:
    return {
        "scheduler": SchedulerConfig(max_prefill_tokens=CHUNK),
        "deadlines": RequestDeadlines(
            waiting_s=waiting_s, prefill_progress_s=progress_s, **deadlines
        ),
    }


async def test_a_prefill_three_times_longer_than_the_queue_deadline_completes(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
):
    waiting_s = 0.2
    engine = await started(runner, **engine_config(waiting_s, progress_s=1.0))
    # A slowed worker: each chunk step takes STEP_S (simulated compute, not a test wait).
    durations = slow_prefill(engine, monkeypatch, lambda _: time.sleep(STEP_S))
    try:
        prompt = [(7 * i) % 200 + 3 for i in range(8 * CHUNK)]  # 8 chunks
        outs = await collect(engine, "long", prompt, max_tokens=3, ignore_eos=True)
        assert sum(len(o.token_ids) for o in outs) == 3
        assert outs[-1].finish_reason == "length"
        assert len(durations) == 8 and sum(durations) >= 3 * waiting_s
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_a_prefill_that_stops_making_progress_times_out_prefilling(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
):
    engine = await started(runner, **engine_config(waiting_s=30.0, progress_s=0.3))
    stuck, release = threading.Event(), threading.Event()

    def hang_at_second_chunk(step: int) -> None:
        if step == 1:
            stuck.set()
            release.wait(30.0)  # the stuck worker, until the test lets it go

    slow_prefill(engine, monkeypatch, hang_at_second_chunk)
    try:
        prompt = [(5 * i) % 200 + 3 for i in range(4 * CHUNK)]
        task = asyncio.create_task(collect(engine, "stuck", prompt, max_tokens=2))
        assert await asyncio.to_thread(stuck.wait, 10.0)
        [info] = engine.debug_requests()
        assert info["state"] == "prefilling" and info["deadline"] == "timeout:prefilling"
        assert info["last_transition"] == ["waiting", "prefilling", "prefill starts"]
        with pytest.raises(EngineError) as err:
            await asyncio.wait_for(task, 10.0)
        assert err.value.status == 504 and err.value.code == "timeout:prefilling"
        assert "state prefilling" in err.value.message
        release.set()
        await assert_idle(engine)
    finally:
        release.set()
        await engine.stop()


async def test_a_prompt_too_long_for_its_deadline_is_refused_with_the_estimate(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
):
    engine = await started(runner, **engine_config(30.0, 30.0, request_s=1.0))
    durations = slow_prefill(engine, monkeypatch, lambda _: time.sleep(STEP_S))
    try:
        assert engine.prefill_rate.tokens_per_s is None  # nothing measured: nothing refused
        await collect(engine, "measure", list(range(3, 3 + 2 * CHUNK)), max_tokens=1)
        rate = engine.prefill_rate.tokens_per_s
        assert rate is not None and rate < CHUNK / STEP_S
        num_steps = len(durations)
        long_prompt = [(3 * i) % 200 + 3 for i in range(int(rate * 2) + CHUNK)]  # ~2 s > 1 s
        with pytest.raises(EngineError) as err:
            await collect(engine, "too-long", long_prompt, max_tokens=1)
        assert err.value.status == 400 and err.value.code == "prefill_exceeds_deadline"
        assert f"{len(long_prompt)} tokens" in err.value.message and "tokens/s" in err.value.message
        assert len(durations) == num_steps, "refused before any step computed it"
        short = await collect(engine, "fits", list(range(3, 3 + CHUNK)), max_tokens=1)
        assert short[-1].finish_reason is not None
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_waiting_prefilling_running_is_the_lifecycle_of_a_colocated_request(
    runner: ModelRunner,
):
    engine = await started(runner)
    try:
        req = GenerateRequest("life", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
        gen = engine.generate(req)
        await asyncio.wait_for(anext(gen), 10.0)
        [info] = engine.debug_requests()
        assert info["state"] == "running"
        assert info["last_transition"] == ["prefilling", "running", "prefilled"]
        assert info["deadline"] is None  # RUNNING has only the overall deadline
        await gen.aclose()
        await assert_idle(engine)
    finally:
        await engine.stop()
