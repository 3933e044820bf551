"""Run requests through an engine with and without speculation; what a client sees of each."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.protocol import GenerateRequest
from pdserve.engine.scheduler import SchedulerConfig
from pdserve.model_runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.spec.config import SpeculativeConfig
from pdserve.spec.stats import SpecStats
from tests.engine.test_engine import assert_idle

# A request: its prompt, its sampling and, for a structured output, what makes its matcher.
Req = tuple[list[int], SamplingParams] | tuple[list[int], SamplingParams, Callable[[], object]]


@dataclass(frozen=True)
class Seen:
    """Every token id, its logprob's bits and top-2, the text and how the stream ended."""

    tokens: tuple[tuple[int, float | None, tuple], ...]
    ids: tuple[int, ...]
    text: str
    finish: str | None
    num_generated: int


def both(
    runner: ModelRunner, requests: Sequence[Req], spec: SpeculativeConfig, **kw: object
) -> tuple[list[Seen], list[Seen], SpecStats]:
    """What clients see without and with ``spec``, and the speculation's counters."""
    plain, _ = asyncio.run(run_engine(runner, requests, None, **kw))  # type: ignore[arg-type]
    seen, stats = asyncio.run(run_engine(runner, requests, spec, **kw))  # type: ignore[arg-type]
    assert stats is not None
    return plain, seen, stats


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, logprobs=True, top_logprobs=2, **kw)


def seeded(n: int, seed: int, **kw: object) -> SamplingParams:
    return SamplingParams(
        max_tokens=n, temperature=0.8, top_p=0.9, seed=seed, logprobs=True, top_logprobs=2, **kw
    )


async def run_engine(
    runner: ModelRunner,
    requests: Sequence[Req],
    spec: SpeculativeConfig | None,
    *,
    budget: int = 2048,
    caching: bool = True,
    warm: Sequence[list[int]] = (),
) -> tuple[list[Seen], SpecStats | None]:
    """``warm`` prompts first (filling the prefix cache), then ``requests`` all at once; the
    engine is idle (every page back) at the end."""
    sched = SchedulerConfig(prefix_caching=caching, max_prefill_tokens=budget)
    engine = Engine(EngineConfig(scheduler=sched, speculative=spec), runner, incarnation="t")
    await engine.start()
    try:
        for i, ids in enumerate(warm):
            req = GenerateRequest(f"warm{i}", ids, SamplingParams(max_tokens=2, temperature=0))
            _ = [o async for o in engine.generate(req)]

        async def one(i: int, ids: list[int], sp: SamplingParams, *grammar: Callable) -> Seen:
            req = GenerateRequest(f"r{i}", list(ids), copy.deepcopy(sp))
            if grammar:
                req.grammar = grammar[0]()
            outs = [o async for o in engine.generate(req)]
            lps = [lp for o in outs for lp in (o.logprobs or [])]
            ids_out = tuple(t for o in outs for t in o.token_ids)
            toks = tuple((lp.token_id, lp.logprob, lp.top) for lp in lps)
            return Seen(toks, ids_out, "".join(o.text for o in outs), outs[-1].finish_reason,
                        outs[-1].num_generated_tokens)  # fmt: skip

        seen = await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests)))
        await assert_idle(engine)
        spec_obj = engine.steps.speculator
        return list(seen), spec_obj.stats if spec_obj is not None else None
    finally:
        await engine.stop()
