"""On the real pair (Qwen2.5-Coder-1.5B-Instruct Q4_K_M, its 0.5B as the draft; the same
tokenizer): speculation, draft-model and n-gram, gives the plain stream's tokens and logprobs,
greedy and seeded, for a code prompt whose answer repeats parts of it."""

from __future__ import annotations

import pytest

from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.spec.config import SpeculativeConfig
from tests.real_models import QWEN_05B, QWEN_15B, real_model

from .harness import both, greedy, seeded

PROMPT = (
    "<|im_start|>user\nRename `total` to `acc` in this function and show the whole function:\n"
    "def sum_list(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total\n"
    "<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def qwen_target() -> ModelRunner:
    return ModelRunner(RunnerConfig(str(real_model(QWEN_15B)), page_size=16, num_pages=64))


def test_real_pair_streams_are_the_plain_ones(qwen_target: ModelRunner) -> None:
    draft = SpeculativeConfig("draft", num_speculative_tokens=4,
                              draft_model=str(real_model(QWEN_05B)), adaptive=False)  # fmt: skip
    ngram = SpeculativeConfig("ngram", num_speculative_tokens=4, adaptive=False)
    ids = qwen_target.tokenizer.encode(PROMPT)
    for spec in (draft, ngram):  # greedy and seeded side by side (one engine each way)
        plain, seen, stats = both(qwen_target, [(ids, greedy(24)), (ids, seeded(24, 3))], spec)
        assert seen == plain
        assert stats.accepted_tokens > 0  # a code answer: the drafts are often right
