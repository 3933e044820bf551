"""Structured outputs in the engine loop: the matcher advances per token, a complete grammar
ends the request, and unconstrained neighbours in the same batch are untouched."""

from __future__ import annotations

import asyncio
import re

from pdserve.engine.protocol import GenerateOutput, GenerateRequest
from pdserve.grammar import GrammarCompiler, GrammarSpec
from pdserve.model_runner import ModelRunner
from pdserve.sampling_params import SamplingParams

from .test_engine import assert_idle, collect, started, tokens

PATTERN = r"(ab|cd)[0-9]{2,4}x"


def _compiler(runner: ModelRunner) -> GrammarCompiler:
    tok = runner.tokenizer
    return GrammarCompiler(tok.backend.to_str(), tok.vocab_size, tok.eos_token_ids)


async def _constrained(
    engine, runner, rid: str, prompt: list[int], pattern: str = PATTERN, **sp
) -> list[GenerateOutput]:
    req = GenerateRequest(rid, prompt, SamplingParams(**sp))
    req.grammar = _compiler(runner).compile(GrammarSpec("regex", pattern))
    return [out async for out in engine.generate(req)]


async def test_constrained_request_ends_at_the_grammar_and_spares_its_neighbours(
    runner: ModelRunner,
):
    engine = await started(runner)
    try:
        prompt = runner.tokenizer.encode("Hello world")
        free = dict(max_tokens=12, temperature=0.7, seed=3, ignore_eos=True)
        solo = tokens(await collect(engine, "solo", prompt, **free))
        constrained, neighbour = await asyncio.gather(
            _constrained(engine, runner, "g", prompt, max_tokens=30, temperature=0.9, seed=1),
            collect(engine, "n", prompt, **free),
        )
        assert tokens(neighbour) == solo
        text = "".join(o.text for o in constrained)
        assert re.fullmatch(PATTERN, text), text
        assert constrained[-1].finish_reason == "stop"
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_constrained_requests_survive_preemption(small_runner: ModelRunner, monkeypatch):
    engine = await started(small_runner)
    preempted: list[str] = []
    scheduler = engine.scheduler
    original = scheduler._preempt

    def spy(req):  # record, then preempt as usual
        preempted.append(req.request_id)
        original(req)

    monkeypatch.setattr(scheduler, "_preempt", spy)
    try:
        # 4 x (6 + 20) tokens need 28 pages of 4 tokens; the cache holds 24.
        prompts = [[7 + i] * 6 for i in range(4)]
        outs = await asyncio.gather(
            *(_constrained(engine, small_runner, f"c{i}", p, "[a-z]{200}", max_tokens=20,
                           temperature=0) for i, p in enumerate(prompts))
        )  # fmt: skip
        assert preempted  # the re-prefilled requests continued their grammars
        for out in outs:
            text = "".join(o.text for o in out)
            assert re.fullmatch("[a-z]+", text) and out[-1].finish_reason == "length", text
        await assert_idle(engine)
    finally:
        await engine.stop()
