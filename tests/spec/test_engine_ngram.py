"""N-gram speculation changes no token: text, token ids and logprobs equal the plain stream's,
greedy and seeded, alone and among batch mates, across chunked prefill and cache hits."""

from __future__ import annotations

import asyncio

from pdserve.model_runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.spec.config import SpeculativeConfig

from .harness import both, greedy, run_engine, seeded

NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                          prompt_lookup_max=3, disable_batch_size=8, adaptive=False)  # fmt: skip
CODE = "def main(argv):\n    return 0\n\nclass Page:\n    pass\n"


def prompts(runner: ModelRunner) -> list[list[int]]:
    tok = runner.tokenizer
    return [tok.encode(CODE * 3), tok.encode("class Page:\n    pass\n" * 4), tok.encode(CODE)]


def test_greedy_alone_is_the_plain_stream(target: ModelRunner) -> None:
    for ids in prompts(target):
        plain, spec, stats = both(target, [(ids, greedy(24, ignore_eos=True))], NGRAM)
        assert spec == plain
        assert stats is not None and stats.verify_steps > 0
    assert stats.accepted_tokens > 0  # the repeating prompts are found again


def biased(ids: list[int]) -> dict[int, float]:
    """The demo model is random (near-flat): a bias towards a few prompt tokens makes its
    sampled output repeat the prompt, so n-gram drafts exist and some are accepted."""
    return {t: 6.0 for t in set(ids[:6])}


def test_seeded_alone_is_the_plain_stream(target: ModelRunner) -> None:
    drafted = accepted = 0
    for seed, ids in enumerate(prompts(target)):
        for bias in ({}, biased(ids)):
            sp = seeded(24, seed, ignore_eos=True, logit_bias=bias)
            plain, spec, stats = both(target, [(ids, sp)], NGRAM)
            assert spec == plain
            assert stats is not None
            drafted, accepted = drafted + stats.draft_tokens, accepted + stats.accepted_tokens
    assert drafted > accepted > 0  # verify rows of seeded sampling, kept and rolled back


def test_among_seven_batch_mates_chunked_and_cached(target: ModelRunner) -> None:
    ps = prompts(target)
    reqs: list[tuple[list[int], SamplingParams]] = []
    for i in range(8):
        ids = ps[i % 3] + target.tokenizer.encode(f" x{i}")
        bias = biased(ids) if i % 4 == 0 else {}
        sp = (
            greedy(20, ignore_eos=True)
            if i % 2
            else seeded(20, i, ignore_eos=True, logit_bias=bias)
        )
        reqs.append((ids, sp))
    plain, _ = asyncio.run(run_engine(target, reqs, None))
    for budget, warm in ((2048, ()), (7, ()), (2048, ps)):
        spec, stats = asyncio.run(run_engine(target, reqs, NGRAM, budget=budget, warm=warm))
        assert spec == plain, f"budget {budget}, warm {bool(warm)}"
        assert stats is not None and stats.verify_steps > 0
