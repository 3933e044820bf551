"""The invariance matrix on the real default model (SmolLM2-135M-Instruct, the shipped Q4_1 GGUF:
quantized projections, float32 activations, a bf16 KV cache), as served: a request's greedy and
seeded tokens, their logprobs and top-2 are bit-identical alone, chunked at any budget, over a
prefix cache hit of any length and beside 7 batch mates (tests/engine/test_invariance.py holds
the same on the demo model, with a property test over all of them)."""

from __future__ import annotations

import pytest

from pdserve.model_runner import ModelRunner, RunnerConfig
from tests.engine.test_invariance import PAGE, alone, run
from tests.real_models import SMOLLM2, real_model


@pytest.fixture(scope="module")
def smollm_runner() -> ModelRunner:
    path = real_model(SMOLLM2)
    return ModelRunner(RunnerConfig(str(path), page_size=PAGE, num_pages=256))


def real_prompt(length: int, salt: int) -> list[int]:
    """Ordinary vocabulary ids (SmolLM2's specials are below 100)."""
    return [(salt * 7919 + 131 * i) % 49000 + 100 for i in range(length)]


@pytest.mark.parametrize("seed", [None, 1234])
async def test_real_model_tokens_and_logprobs_ignore_chunking_cache_hits_and_batch_mates(
    smollm_runner: ModelRunner, seed: int | None
) -> None:
    ids = real_prompt(60, 1)
    expected = await alone(smollm_runner, ids, seed)
    for budget in (8, 37, 512):
        [got] = await run(smollm_runner, [(ids, seed)], budget=budget, caching=False)
        assert got == expected, f"chunked at {budget}"
    for shared in (4, 21, 44):  # prefix hits of 1, 5 and 11 pages
        warm = [ids[:shared] + real_prompt(5, 9)]
        [got] = await run(smollm_runner, [(ids, seed)], budget=16, caching=True, warm=warm)
        assert got == expected, f"a cache hit of {shared} tokens"
    mates = [(real_prompt(5 + 9 * i, 10 + i), i if i % 2 else None) for i in range(7)]
    traces = await run(smollm_runner, [(ids, seed), *mates], budget=48, caching=True)
    assert traces[0] == expected, "beside 7 batch mates"
