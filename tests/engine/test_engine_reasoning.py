"""Reasoning in the engine, on the Qwen3-architecture thinking demo with the real grammar
matcher: the thinking tokens are sampled unconstrained, the JSON grammar starts at the token
after </think>, the thinking budget forces </think> at the budget, and none of it depends on the
batch."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from pdserve.engine.protocol import GenerateOutput, GenerateRequest
from pdserve.grammar import GrammarCompiler, GrammarSpec
from pdserve.kernels.logits_processors import unpack_bitmask
from pdserve.model.demo import DemoShape, write_demo_model
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.reasoning.gate import ReasoningSpec, starts_thinking
from pdserve.sampling_params import SamplingParams

from .test_engine import assert_idle, started, tokens

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "unit": {"enum": ["cm", "m"]}},
    "required": ["answer", "unit"],
}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("think"), DemoShape(thinking=True))


@pytest.fixture(scope="module")
def runner(demo_dir: Path) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=str(demo_dir), kv_cache_bytes=16 << 20))


@pytest.fixture(scope="module")
def small_runner(demo_dir: Path) -> ModelRunner:
    """A KV cache so small that a few concurrent requests force preemption."""
    return ModelRunner(RunnerConfig(model_dir=str(demo_dir), page_size=4, num_pages=24))


def _tags(runner: ModelRunner) -> tuple[int, int]:
    tok = runner.tokenizer
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    assert start is not None and end is not None
    return start, end


def _prompt(runner: ModelRunner, **template: object) -> list[int]:
    tok = runner.tokenizer
    messages = [{"role": "user", "content": "How long is the table? Answer in JSON."}]
    return tok.encode(tok.apply_chat_template(messages, True, **template), False)


def _spec(runner: ModelRunner, prompt: list[int], budget: int | None) -> ReasoningSpec:
    start, end = _tags(runner)
    text = lambda t: runner.tokenizer.decode([t], False)  # noqa: E731
    return ReasoningSpec(start, end, starts_thinking(prompt, start, end, text), budget)


def _compiler(runner: ModelRunner) -> GrammarCompiler:
    tok = runner.tokenizer
    return GrammarCompiler(tok.backend.to_str(), tok.vocab_size, tok.eos_token_ids)


async def _run(
    engine, runner, rid, prompt, budget, is_json: bool = True, **sp
) -> list[GenerateOutput]:
    grammar = _compiler(runner).compile(GrammarSpec.json_schema(SCHEMA)) if is_json else None
    req = GenerateRequest(
        rid, prompt, SamplingParams(**sp), grammar=grammar, reasoning=_spec(runner, prompt, budget)
    )
    return [out async for out in engine.generate(req)]


SAMPLED = dict(max_tokens=120, temperature=0.9, seed=11)


async def test_thinking_is_unconstrained_then_the_answer_is_valid_json(runner) -> None:
    engine = await started(runner)
    _, end = _tags(runner)
    try:
        prompt = _prompt(runner)
        assert _spec(runner, prompt, None).is_thinking  # the template leaves the block to it
        outs = await _run(engine, runner, "j", prompt, 8, **SAMPLED)
        ids = tokens(outs)
        pos = ids.index(end)
        assert pos == 8  # the random model never closes it: the budget did
        # The same request without a grammar thinks the same tokens: none was masked.
        free = tokens(await _run(engine, runner, "f", prompt, 8, is_json=False, **SAMPLED))
        assert free[: pos + 1] == ids[: pos + 1]
        # ... and the grammar would have refused the very first of them.
        first_mask = _compiler(runner).compile(GrammarSpec.json_schema(SCHEMA)).bitmask()
        assert not unpack_bitmask(first_mask[None], runner.tokenizer.vocab_size)[0, ids[0]]
        answer = json.loads(runner.tokenizer.decode(ids[pos + 1 :]))
        assert set(answer) == {"answer", "unit"} and isinstance(answer["answer"], int)
        assert outs[-1].finish_reason == "stop"  # the grammar completed
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_a_prompt_that_closes_the_block_constrains_from_the_first_token(runner) -> None:
    engine = await started(runner)
    try:
        prompt = _prompt(runner, enable_thinking=False)
        assert not _spec(runner, prompt, None).is_thinking
        outs = await _run(engine, runner, "n", prompt, 0, **SAMPLED)
        assert set(json.loads("".join(o.text for o in outs))) == {"answer", "unit"}
        assert _tags(runner)[1] not in tokens(outs)  # the budget of 0 forced nothing
    finally:
        await engine.stop()


@pytest.mark.parametrize("budget", [0, 1, 5])
async def test_the_budget_forces_the_end_of_thinking_token_at_the_budget(runner, budget) -> None:
    engine = await started(runner)
    _, end = _tags(runner)
    try:
        prompt = _prompt(runner)
        unlimited = tokens(await _run(engine, runner, "u", prompt, None, False, max_tokens=12,
                                      temperature=0, ignore_eos=True))  # fmt: skip
        assert end not in unlimited  # left alone, the model does not close the block
        ids = tokens(await _run(engine, runner, "b", prompt, budget, False, max_tokens=12,
                                temperature=0, ignore_eos=True))  # fmt: skip
        assert ids.index(end) == budget and ids[:budget] == unlimited[:budget]
        assert ids.count(end) == 1  # once out of the block, nothing is forced
    finally:
        await engine.stop()


async def test_thinking_then_json_tokens_do_not_depend_on_the_batch(runner) -> None:
    engine = await started(runner)
    try:
        prompt = _prompt(runner)
        alone = tokens(await _run(engine, runner, "a", prompt, 6, **SAMPLED))
        batched = await asyncio.gather(
            _run(engine, runner, "b", prompt, 6, **SAMPLED),
            _run(engine, runner, "c", prompt, 3, **{**SAMPLED, "seed": 2}),
            _run(engine, runner, "d", _prompt(runner, enable_thinking=False), None, False,
                 max_tokens=40, temperature=0.7, seed=4),
        )  # fmt: skip
        assert tokens(batched[0]) == alone
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_preempted_thinking_requests_resume_their_block_and_grammar(
    small_runner, monkeypatch
) -> None:
    engine = await started(small_runner)
    preempted: list[str] = []
    original = engine.scheduler._preempt

    def spy(req):  # record, then preempt as usual
        preempted.append(req.request_id)
        original(req)

    monkeypatch.setattr(engine.scheduler, "_preempt", spy)
    try:
        prompt = _prompt(small_runner)
        runs = [dict(SAMPLED, seed=s, max_tokens=60) for s in range(4)]
        solo = [tokens(await _run(engine, small_runner, f"s{i}", prompt, 30, **sp))
                for i, sp in enumerate(runs)]  # fmt: skip
        together = await asyncio.gather(
            *(_run(engine, small_runner, f"t{i}", prompt, 30, **sp) for i, sp in enumerate(runs))
        )
        assert preempted  # some were re-prefilled mid-way, their thinking state kept
        assert all(s.index(_tags(small_runner)[1]) == 30 for s in solo)
        assert [tokens(t) for t in together] == solo
        await assert_idle(engine)
    finally:
        await engine.stop()
