"""On the real default model (SmolLM2-135M-Instruct, the shipped Q4_1 GGUF), pdserve's default
numerics follow a float32 reference on the same weights (transformers' GGUF loading, dequantized
to float32) at least as well as transformers itself does in bf16, and the factual questions
start their answers as float32 does (bench/fidelity.py runs the full prompt set)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.fidelity import NUM_FACTUAL, greedy, load_hf, pdserve_greedy, prompt_ids, score
from tests.real_models import SMOLLM2, real_model

NUM_TOKENS = 16
NUM_COMPLETIONS = 2


@pytest.fixture(scope="module")
def smollm() -> Path:
    return real_model(SMOLLM2)


def test_default_numerics_agree_with_float32_at_least_as_well_as_transformers_bf16(
    smollm: Path,
) -> None:
    hf_dir, name = str(smollm.parent), smollm.name
    everything = prompt_ids(hf_dir, name)
    num_chat = len(everything) - 12  # prompt_ids: the chat questions, then 12 completions
    prompts = everything[:NUM_FACTUAL] + everything[num_chat : num_chat + NUM_COMPLETIONS]
    reference = load_hf(hf_dir, name, torch.float32)  # one GGUF dequantization for both
    ref = greedy(reference, prompts, NUM_TOKENS)
    hf_bf16 = score("transformers bf16", greedy(reference.to(torch.bfloat16), prompts, NUM_TOKENS),
                    ref)  # fmt: skip
    ours = score("pdserve", pdserve_greedy(str(smollm), "auto", prompts, NUM_TOKENS), ref)
    assert ours.mean_agreeing_tokens >= hf_bf16.mean_agreeing_tokens, (ours, hf_bf16)
    assert ours.factual_first_tokens_equal == NUM_FACTUAL, ours
