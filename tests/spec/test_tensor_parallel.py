"""Speculation over a tensor-parallel target: the verify step's forward and LM head run on
every rank, and the streams are TP1's plain streams, token for token and logprob for logprob
(greedy and seeded; the n-gram drafter and a draft model, which runs unsplit on rank 0)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.spec.config import SpeculativeConfig
from tests.spec.conftest import PAGE
from tests.spec.harness import greedy, run_engine, seeded
from tests.spec.test_engine_ngram import NGRAM, prompts

pytestmark = pytest.mark.slow


def _runner(demo_dir: Path, tp: int) -> ModelRunner:
    config = RunnerConfig(str(demo_dir), page_size=PAGE, num_pages=512, tensor_parallel_size=tp)
    return ModelRunner(config)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_at_tp2_streams_tp1_s_plain_tokens_and_logprobs(
    method: str, demo_dir: Path, draft_dir: Path
) -> None:
    spec = NGRAM if method == "ngram" else SpeculativeConfig(
        "draft", num_speculative_tokens=3, draft_model=str(draft_dir), adaptive=False,
        disable_batch_size=8,
    )  # fmt: skip
    tp1 = _runner(demo_dir, 1)
    requests = [(ids, greedy(16, ignore_eos=True)) for ids in prompts(tp1)]
    requests += [(ids, seeded(16, 5, ignore_eos=True)) for ids in prompts(tp1)[:2]]
    plain, _ = asyncio.run(run_engine(tp1, requests, None))
    tp2 = _runner(demo_dir, 2)  # its engine's stop ends its ranks
    seen, stats = asyncio.run(run_engine(tp2, requests, spec))
    assert seen == plain
    assert stats is not None and sum(stats.drafted_per_pos) > 0  # it did speculate
