"""Structured outputs in the engine loop: the matcher advances per token, a complete grammar
ends the request, unconstrained neighbours in the same batch are untouched, and every mask is
filled in the background (never on the runner's thread, never for an unconstrained batch)."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.protocol import EngineError, GenerateOutput, GenerateRequest
from pdserve.engine.scheduler import SchedulerConfig
from pdserve.grammar import GrammarCompiler, GrammarMatcher, GrammarSpec
from pdserve.grammar.filler import MaskFiller, shared_filler
from pdserve.model_runner import ModelRunner
from pdserve.sampling_params import SamplingParams

from .test_engine import assert_idle, collect, started, tokens

PATTERN = r"(ab|cd)[0-9]{2,4}x"


def _compiler(runner: ModelRunner) -> GrammarCompiler:
    tok = runner.tokenizer
    return GrammarCompiler(tok.backend.to_str(), tok.vocab_size, tok.eos_token_ids)


async def _constrained(
    engine, runner, rid: str, prompt: list[int], pattern: str = PATTERN, grammar=None, **sp
) -> list[GenerateOutput]:
    req = GenerateRequest(rid, prompt, SamplingParams(**sp))
    req.grammar = grammar or _compiler(runner).compile(GrammarSpec("regex", pattern))
    return [out async for out in engine.generate(req)]


@pytest.fixture
def fills(monkeypatch) -> dict[str, list[str]]:
    """The threads that filled masks, the matchers submitted to the filler, and how many
    went in each hand-off."""
    seen: dict[str, list] = {"threads": [], "submitted": [], "hand_offs": []}
    fill_now, submit = GrammarMatcher.fill_now, MaskFiller.submit

    def spy_fill(self: GrammarMatcher) -> None:
        seen["threads"].append(threading.current_thread().name)
        fill_now(self)

    def spy_submit(self: MaskFiller, matchers: list[GrammarMatcher]) -> None:
        seen["submitted"] += [id(m) for m in matchers]
        seen["hand_offs"].append(len(matchers))
        submit(self, matchers)

    monkeypatch.setattr(GrammarMatcher, "fill_now", spy_fill)
    monkeypatch.setattr(MaskFiller, "submit", spy_submit)
    return seen


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


async def test_an_unconstrained_batch_never_starts_a_fill(runner: ModelRunner, fills) -> None:
    engine = await started(runner)
    try:
        prompt = runner.tokenizer.encode("Hello world")
        free = dict(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True)
        await asyncio.gather(
            collect(engine, "a", prompt, **free), collect(engine, "b", prompt, **free)
        )
        assert fills == {"threads": [], "submitted": [], "hand_offs": []}
        out = await _constrained(engine, runner, "g", prompt, max_tokens=30, temperature=0)
        num_tokens = len(tokens(out))
        # Each of its masks prefetched (the first before its prefill), none filled by the runner.
        assert len(fills["submitted"]) == num_tokens
        assert "pdserve-runner" not in fills["threads"] and fills["threads"]
        await assert_idle(engine)
    finally:
        await engine.stop()


class FailingAfter:
    """An llguidance matcher whose fills fail from the ``n``-th on (everything else real)."""

    def __init__(self, inner, n: int) -> None:
        self._inner, self._left = inner, n

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        self._left -= 1
        if self._left <= 0:
            raise RuntimeError("out of fuel")
        self._inner.unsafe_compute_mask_ptr(ptr, size)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


async def test_a_failed_background_fill_fails_only_its_request(runner: ModelRunner) -> None:
    engine = await started(runner)
    try:
        prompt = runner.tokenizer.encode("Hello world")
        free = dict(max_tokens=12, temperature=0.7, seed=3, ignore_eos=True)
        solo = tokens(await collect(engine, "solo", prompt, **free))
        healthy = _compiler(runner).compile(GrammarSpec("regex", PATTERN))
        inner = _compiler(runner).compile(GrammarSpec("regex", PATTERN)).llguidance_matcher
        broken = GrammarMatcher(
            FailingAfter(inner, 3), runner.tokenizer.vocab_size, shared_filler()
        )
        sp = dict(max_tokens=30, temperature=0.9, seed=1)
        results = await asyncio.gather(
            _constrained(engine, runner, "broken", prompt, grammar=broken, **sp),
            _constrained(engine, runner, "g", prompt, grammar=healthy, **sp),
            collect(engine, "n", prompt, **free),
            return_exceptions=True,
        )
        error, constrained, neighbour = results
        assert isinstance(error, EngineError) and error.status == 500
        assert "bitmask fill failed: out of fuel" in error.message
        assert re.fullmatch(PATTERN, "".join(o.text for o in constrained))
        assert tokens(neighbour) == solo
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_constrained_decode_rows_get_masks_in_mixed_steps(runner: ModelRunner, fills) -> None:
    sched = SchedulerConfig(max_prefill_tokens=32)  # a long prompt takes several mixed steps
    engine = Engine(EngineConfig(scheduler=sched), runner, incarnation="test")
    await engine.start()
    mixed: list[bool] = []
    schedule = engine.scheduler.schedule

    def spy(**kwargs):  # does a mixed step carry a constrained decode row?
        batch = schedule(**kwargs)
        if batch is not None and batch.kind == "mixed":
            mixed.append(any(r.seq.grammar is not None for r in batch.decode))
        return batch

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    try:
        pattern = "[a-z]{60}"
        req = GenerateRequest(
            "g", [5, 6, 7], SamplingParams(max_tokens=60, temperature=1.0, seed=2)
        )
        req.grammar = _compiler(runner).compile(GrammarSpec("regex", pattern))
        stream = engine.generate(req)
        outs = [await asyncio.wait_for(anext(stream), 30)]  # decoding before the long one comes
        long_prompt = [9 + i % 50 for i in range(300)]
        other = asyncio.create_task(collect(engine, "long", long_prompt, max_tokens=2))
        outs += [o async for o in stream]
        await asyncio.wait_for(other, 30)
        assert any(mixed), mixed
        assert re.fullmatch(pattern, "".join(o.text for o in outs))
        assert "pdserve-runner" not in fills["threads"]
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_a_steps_constrained_rows_reach_the_filler_in_one_hand_off(
    runner: ModelRunner, fills
) -> None:
    engine = await started(runner)
    try:
        prompt = runner.tokenizer.encode("Hello world")
        sp = dict(max_tokens=20, temperature=0)
        outs = await asyncio.gather(
            *(_constrained(engine, runner, f"g{i}", prompt, "[a-z]{20}", **sp) for i in range(3))
        )
        for out in outs:
            assert re.fullmatch("[a-z]{20}", "".join(o.text for o in out))
        assert max(fills["hand_offs"]) == 3  # the three rows of a decode step, together
        assert "pdserve-runner" not in fills["threads"]
        await assert_idle(engine)
    finally:
        await engine.stop()
