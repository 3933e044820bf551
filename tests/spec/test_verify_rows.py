"""The verify step's premise: a row of a K+1-row chunk over a cached prefix has the logits of
the plain decode step at its position, bit for bit; the verifier keeps exactly the drafts the
plain sampler would have picked and emits the plain stream's next tokens."""

from __future__ import annotations

import torch

from pdserve.model_runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence
from pdserve.spec.verify import accepted_length, verify


def plain_stream(
    runner: ModelRunner, prompt: list[int], n: int, sp: SamplingParams, first_page: int = 0
) -> tuple[list[int], list[torch.Tensor], list]:
    """Tokens, decode-step logits and logprobs of a prefill then ``n - 1`` decode steps."""
    pages = list(range(first_page, first_page + runner.kv_config.pages_for(len(prompt) + n + 8)))
    seq = Sequence("plain", list(prompt), len(prompt), sp, pages)
    out = runner.prefill([seq])
    toks, lps, logits = list(out.token_ids), [(out.logprobs or [None])[0]], []
    while len(toks) < n:
        seq.num_cached_tokens = seq.num_tokens
        seq.token_ids.append(toks[-1])
        logits.append(runner.decode_logits([seq])[0].clone())
        seq.num_cached_tokens = seq.num_tokens - 1  # recompute the row: sample it as a step
        o = runner.decode([seq])
        toks += o.token_ids
        lps.append((o.logprobs or [None])[0])
    return toks, logits, lps


def test_chunk_rows_have_the_decode_steps_logits(target: ModelRunner) -> None:
    prompt = target.tokenizer.encode("def main(argv):\n    return 0\n")
    sp = SamplingParams(temperature=0)
    toks, logits, _ = plain_stream(target, prompt, 9, sp)
    # Same prompt in other pages: prefill, then one chunk of the first token and 7 more.
    pages = list(range(100, 100 + target.kv_config.pages_for(len(prompt) + 16)))
    seq = Sequence("chunk", list(prompt), len(prompt), sp, pages)
    target.prefill([seq])
    seq.num_cached_tokens = seq.num_tokens
    seq.token_ids += toks[:8]
    rows, _ = target.extend_logits([seq])
    assert rows.shape[0] == 8
    for j in range(8):
        assert torch.equal(rows[j], logits[j]), f"row {j} differs from its decode step"


def _verify_matches_plain(runner: ModelRunner, sp: SamplingParams, bad_at: int | None) -> None:
    prompt = runner.tokenizer.encode("class Page:\n    pass\n")
    toks, _, lps = plain_stream(runner, prompt, 8, sp)
    pages = list(range(200, 200 + runner.kv_config.pages_for(len(prompt) + 16)))
    seq = Sequence("v", list(prompt), len(prompt), sp, pages)
    first = runner.prefill([seq]).token_ids[0]
    assert first == toks[0]
    seq.num_cached_tokens = seq.num_tokens
    seq.token_ids.append(first)
    drafts = list(toks[1:6])
    if bad_at is not None:
        drafts[bad_at] = (drafts[bad_at] + 1) % 100
    out = verify(runner, [seq], [drafts])
    keep = 5 if bad_at is None else bad_at
    assert out.runs == [toks[1 : 2 + keep]]
    if sp.logprobs:
        assert out.run_logprobs == [lps[1 : 2 + keep]]


def test_verify_keeps_the_plain_greedy_stream(target: ModelRunner) -> None:
    sp = SamplingParams(temperature=0, logprobs=True, top_logprobs=2, ignore_eos=True)
    for bad_at in (None, 0, 2, 4):
        _verify_matches_plain(target, sp, bad_at)


def test_verify_keeps_the_plain_seeded_stream(target: ModelRunner) -> None:
    sp = SamplingParams(
        temperature=0.8, top_p=0.9, seed=11, logprobs=True, top_logprobs=2, ignore_eos=True
    )
    for bad_at in (None, 1, 3):
        _verify_matches_plain(target, sp, bad_at)


def test_accepted_length_stops_at_the_first_disagreement() -> None:
    assert accepted_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accepted_length([1, 9, 3], [1, 2, 3, 4]) == 1
    assert accepted_length([], [5]) == 0
