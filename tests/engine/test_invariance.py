"""A token's result never depends on its batch mates, its prompt's chunking or the prefix cache,
at the dtype users serve (the demo checkpoint is bf16: float32 activations over bf16 weights and
a bf16 KV cache). Greedy and seeded tokens and their logprobs are compared bit for bit against
the same request run alone, uncached and unchunked; a stream preempted for a request of higher
priority and resumed gives the same trace too."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.protocol import GenerateOutput, GenerateRequest
from pdserve.engine.scheduler import SchedulerConfig
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sampling_params import SamplingParams
from tests.engine.test_engine import assert_idle

PAGE = 4
NUM_TOKENS = 10
# What a client sees of a request: every token id and its logprob (float bits), the top-2 too.
Trace = list[tuple[int, float, tuple[tuple[int, float], ...]]]


@pytest.fixture(scope="module")
def served_runner(demo_dir: Path) -> ModelRunner:
    runner = ModelRunner(RunnerConfig(str(demo_dir), page_size=PAGE, num_pages=256))
    assert runner.dtype == torch.bfloat16, "the demo checkpoint is served in bf16"
    assert runner.kv_pool.config.dtype == torch.bfloat16
    return runner


def params(seed: int | None) -> SamplingParams:
    """Greedy (``seed`` None) or seeded sampling, with logprobs."""
    temperature = 0.0 if seed is None else 0.9
    return SamplingParams(
        max_tokens=NUM_TOKENS, temperature=temperature, seed=seed, ignore_eos=True,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip


def trace(outs: list[GenerateOutput]) -> Trace:
    return [(lp.token_id, lp.logprob, lp.top) for o in outs for lp in (o.logprobs or [])]


async def run(
    runner: ModelRunner,
    requests: list[tuple[list[int], int | None]],
    *,
    budget: int,
    caching: bool,
    warm: Sequence[list[int]] = (),
) -> list[Trace]:
    """``warm`` prompts run first (filling the prefix cache), then ``requests`` all at once."""
    chunked = budget < 10_000
    sched = SchedulerConfig(
        prefix_caching=caching, chunked_prefill=chunked, max_prefill_tokens=budget
    )
    engine = Engine(EngineConfig(scheduler=sched), runner, incarnation="test")
    await engine.start()
    try:
        for i, ids in enumerate(warm):
            req = GenerateRequest(f"warm{i}", ids, SamplingParams(max_tokens=2, temperature=0))
            _ = [o async for o in engine.generate(req)]

        async def one(i: int, ids: list[int], seed: int | None) -> Trace:
            req = GenerateRequest(f"r{i}", ids, params(seed))
            return trace([o async for o in engine.generate(req)])

        out = await asyncio.gather(*(one(i, ids, s) for i, (ids, s) in enumerate(requests)))
        await assert_idle(engine)
        return list(out)
    finally:
        await engine.stop()


async def alone(runner: ModelRunner, ids: list[int], seed: int | None) -> Trace:
    [t] = await run(runner, [(ids, seed)], budget=10_000, caching=False)
    assert len(t) == NUM_TOKENS
    return t


def prompt(length: int, salt: int) -> list[int]:
    return [(salt * 31 + 7 * i) % 250 + 3 for i in range(length)]


@pytest.mark.parametrize("seed", [None, 1234])
@pytest.mark.parametrize("budget", [8, 13, 64, 512])
async def test_chunked_prefill_gives_the_same_tokens_and_logprobs(
    served_runner: ModelRunner, budget: int, seed: int | None
) -> None:
    ids = prompt(45, 1)
    expected = await alone(served_runner, ids, seed)
    [got] = await run(served_runner, [(ids, seed)], budget=budget, caching=False)
    assert got == expected


@pytest.mark.parametrize("shared", [4, 9, 20, 44])
async def test_a_prefix_cache_hit_of_any_length_gives_the_same_tokens_and_logprobs(
    served_runner: ModelRunner, shared: int
) -> None:
    ids = prompt(45, 2)
    expected = await alone(served_runner, ids, None)
    warm = [ids[:shared] + prompt(5, 9)]
    [got] = await run(served_runner, [(ids, None)], budget=16, caching=True, warm=warm)
    assert got == expected


async def test_seven_batch_mates_change_nothing(served_runner: ModelRunner) -> None:
    ids = prompt(30, 3)
    expected = await alone(served_runner, ids, None)
    mates = [(prompt(5 + 9 * i, 10 + i), i if i % 2 else None) for i in range(7)]
    traces = await run(served_runner, [(ids, None), *mates], budget=48, caching=True)
    assert traces[0] == expected


@settings(
    max_examples=12, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
@given(
    length=st.integers(1, 70),
    budget=st.sampled_from([8, 11, 32, 512, 10_000]),
    shared=st.integers(0, 70),
    num_mates=st.integers(0, 7),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
    salt=st.integers(0, 1000),
)
def test_property_any_cache_state_budget_and_batch_mates_give_the_alone_trace(
    served_runner: ModelRunner, length: int, budget: int, shared: int, num_mates: int,
    seed: int | None, salt: int,
) -> None:  # fmt: skip
    ids = prompt(length, salt)
    warm = [ids[: min(shared, length)] + [5, 6]] if shared else []
    mates = [(prompt(3 + 11 * i, salt + i + 1), None) for i in range(num_mates)]

    async def both() -> tuple[Trace, Trace]:
        expected = await alone(served_runner, ids, seed)
        got = await run(served_runner, [(ids, seed), *mates], budget=budget, caching=True,
                        warm=warm)  # fmt: skip
        return expected, got[0]

    expected, got = asyncio.run(both())
    assert got == expected


@pytest.fixture(scope="module")
def tight_runner(demo_dir: Path) -> ModelRunner:
    """18 pages of 4 tokens: a 70-token stream and a 48-token prompt cannot both hold theirs."""
    return ModelRunner(RunnerConfig(str(demo_dir), page_size=PAGE, num_pages=18))


@pytest.mark.parametrize("seed", [None, 77])
async def test_a_stream_preempted_for_a_higher_priority_one_resumes_with_the_same_trace(
    tight_runner: ModelRunner, seed: int | None
) -> None:
    """Under the priority policy a priority-0 prompt that finds no pages preempts the running
    priority-10 stream (its KV freed, full pages left cached); that stream is prefilled again
    over its prompt and generated tokens later and goes on with exactly the alone trace."""
    low_ids, high_ids = prompt(30, 21), prompt(48, 22)
    low_params = params(seed)
    low_params.max_tokens = 40
    expected = await run(tight_runner, [(low_ids, seed)], budget=10_000, caching=False)
    assert len(expected[0]) == NUM_TOKENS  # run() uses params(): the first 10 tokens alone
    sched = SchedulerConfig(policy="priority")
    engine = Engine(EngineConfig(scheduler=sched), tight_runner, incarnation="test")
    await engine.start()
    try:
        alone_engine_trace = trace(
            [o async for o in engine.generate(GenerateRequest("solo", low_ids, low_params))]
        )
        low_params = params(seed)
        low_params.max_tokens = 40
        low = engine.generate(GenerateRequest("low", low_ids, low_params, priority=10))
        first = await asyncio.wait_for(anext(low), 10.0)  # running, holding its pages
        high_req = GenerateRequest("high", high_ids, params(None), priority=0)
        high = asyncio.create_task(_collect(engine.generate(high_req)))
        rest = await asyncio.wait_for(_collect(low), 60.0)
        await asyncio.wait_for(high, 60.0)
        assert engine.scheduler.stats.num_preemptions["priority"] >= 1
        got = trace([first, *rest])
        assert got == alone_engine_trace and got[:NUM_TOKENS] == expected[0]
        await assert_idle(engine)
    finally:
        await engine.stop()


async def _collect(gen: AsyncIterator[GenerateOutput]) -> list[GenerateOutput]:
    return [o async for o in gen]
