"""A real K-quant file (Qwen2.5-Coder-0.5B-Instruct Q4_K_M: Q4_K, Q6_K, Q5_0 and Q8_0 tensors,
QKV biases, a 151,936-token vocabulary) loads, stays packed, and its logits follow transformers'
GGUF loading of the same file (every tensor dequantized to float32 by gguf)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.model.quantized import QuantizedTensor
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sequence import Sequence
from tests.real_models import QWEN_05B, real_model

PROMPT = "def fibonacci(n):"
# Float32 activations, weights and KV on both sides: what differs is the order of the float32
# sums (the packed kernel's fma chains against torch's GEMMs) through 24 layers.
ATOL, RTOL = 2e-4, 1e-4  # measured: 1e-5 at most


@pytest.fixture(scope="module")
def qwen_05b() -> Path:
    return real_model(QWEN_05B)


def test_a_q4_k_m_file_s_logits_follow_transformers_gguf_loading(qwen_05b: Path) -> None:
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(RunnerConfig(str(qwen_05b), dtype="float32", page_size=16, num_pages=4))
    weights = runner.model.weights
    kinds = {p.type_name for layer in weights.layers for w in (layer.qkv, layer.gate_up,
             layer.o_proj, layer.down) for p in (w if isinstance(w, list) else [w])
             if isinstance(p, QuantizedTensor)}  # fmt: skip
    assert {"Q4_K", "Q6_K", "Q5_0"} <= kinds  # the K-quant blocks really run
    assert isinstance(weights.embed, QuantizedTensor)  # the 151,936-row table stays packed
    ids = runner.tokenizer.encode(PROMPT)
    seq = Sequence("s", list(ids), len(ids), page_ids=[0, 1])
    ours = runner.prefill_logits([seq])[0]
    del runner, weights
    reference = AutoModelForCausalLM.from_pretrained(
        str(qwen_05b.parent), gguf_file=qwen_05b.name, dtype=torch.float32,
        attn_implementation="eager",
    ).eval()  # fmt: skip
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0, -1]
    assert int(ours.argmax()) == int(ref.argmax())
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
