"""A migrated request (``GenerateRequest.resume``) continues exactly where another worker
stopped: same tokens (seeded noise and penalties count the resumed tokens as generated), no text
sent twice, ``max_tokens`` and usage over all tokens."""

from __future__ import annotations

import pytest

from pdserve.engine.protocol import GenerateOutput, GenerateRequest, ResumeState
from pdserve.model_runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from tests.engine.test_engine import assert_idle, started, tokens

SAMPLING = {
    "seeded": dict(temperature=1.0, seed=1234, frequency_penalty=0.7, presence_penalty=0.3),
    "greedy": dict(temperature=0.0, repetition_penalty=1.3),
}


async def _run(engine, rid: str, prompt: list[int], resume: ResumeState | None, **sp: object):
    req = GenerateRequest(rid, prompt, SamplingParams(**sp), resume=resume)
    return [out async for out in engine.generate(req)]


def _text(outs: list[GenerateOutput]) -> str:
    return "".join(o.text for o in outs)


@pytest.mark.parametrize("kind", sorted(SAMPLING))
@pytest.mark.parametrize("cut", [1, 6])
async def test_resumed_request_continues_with_the_tokens_of_the_uninterrupted_run(
    runner: ModelRunner, kind: str, cut: int
):
    engine = await started(runner)
    try:
        prompt = runner.tokenizer.encode("The quick brown fox")
        sp = dict(max_tokens=14, ignore_eos=True, **SAMPLING[kind])
        full = await _run(engine, "full", prompt, None, **sp)
        full_ids = tokens(full)
        sent, num_tokens = [], 0
        for out in full:  # what a client had when the first worker died after `cut` tokens
            if num_tokens >= cut:
                break
            sent.append(out)
            num_tokens += len(out.token_ids)
        resume = ResumeState(tuple(full_ids[:num_tokens]), len(_text(sent)))
        rest = await _run(engine, "resumed", prompt, resume, **sp)
        assert tokens(rest) == full_ids[num_tokens:]
        assert _text(sent) + _text(rest) == _text(full)
        assert rest[-1].finish_reason == "length"
        assert rest[-1].num_generated_tokens == 14  # usage counts every generated token
        assert rest[-1].num_prompt_tokens == len(prompt)
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_text_held_back_by_a_stop_string_is_sent_after_resuming(runner: ModelRunner):
    engine = await started(runner)
    try:
        prompt = runner.tokenizer.encode("abc")
        sp = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
        free = await _run(engine, "free", prompt, None, **sp)
        ids, text = tokens(free), _text(free)
        # A stop string that never matches but holds back text: the client got less text
        # than the tokens it was told about.
        sp["stop"] = ["\x00never\x00"]
        held = await _run(engine, "held", prompt, None, **sp)
        first = held[:3]
        num_tokens = len(tokens(first))
        assert len(_text(first)) < len(runner.tokenizer.decode(ids[:num_tokens]))
        resume = ResumeState(tuple(ids[:num_tokens]), len(_text(first)))
        rest = await _run(engine, "resumed", prompt, resume, **sp)
        assert _text(first) + _text(rest) == text
        await assert_idle(engine)
    finally:
        await engine.stop()


@pytest.mark.parametrize("cut", [1, 5, 11])
async def test_a_resume_is_one_prefill_and_continues_with_the_same_logprobs(
    runner: ModelRunner, cut: int
):
    """The resumed tokens' KV comes from one prefill of prompt + tokens (no step per token
    streamed before), and by batch invariance the continuation's logprobs are the
    uninterrupted run's, bit for bit."""
    engine = await started(runner)
    try:
        prompt = runner.tokenizer.encode("Once upon a time")
        sp = dict(max_tokens=14, ignore_eos=True, temperature=0.0, logprobs=True, top_logprobs=2)
        full = await _run(engine, "full", prompt, None, **sp)
        full_lps = [(lp.token_id, lp.logprob, lp.top) for o in full for lp in o.logprobs or []]
        ids = [t for t, _, _ in full_lps]
        decode_steps = runner.stats.num_decode_steps
        resume = ResumeState(tuple(ids[:cut]), 0)
        rest = await _run(engine, "resumed", prompt, resume, **sp)
        rest_lps = [(lp.token_id, lp.logprob, lp.top) for o in rest for lp in o.logprobs or []]
        assert rest_lps == full_lps[cut:]
        # One prefill gave the first new token; each later token is one decode step.
        assert runner.stats.num_decode_steps - decode_steps == 14 - cut - 1
        await assert_idle(engine)
    finally:
        await engine.stop()
