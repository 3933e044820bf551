"""GGUF weights against transformers' GGUF loading of the same file, per storage type."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from pdserve.model.checkpoint import declared_dtype, load_model_config
from pdserve.model.gguf.weights import unpermute_rows
from pdserve.model.quantized import QuantizedTensor
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sequence import Sequence
from tests.model.checkpoints import ARCHS, write_checkpoint
from tests.model.gguf.conftest import demo_gguf
from tests.model.gguf.writer import _permute, write_gguf

NUM_DECODE_STEPS = 6
PAGE_SIZE = 4
MIXED = {"attn_v.weight": GGMLQuantizationType.Q8_0, "ffn_up.weight": GGMLQuantizationType.F16}


def _reference(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _runner(path: Path, dtype: str = "float32", device: str = "cpu") -> ModelRunner:
    config = RunnerConfig(str(path), dtype=dtype, page_size=PAGE_SIZE, num_pages=64, device=device)
    return ModelRunner(config)


def _greedy_logits(runner: ModelRunner, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    seq = Sequence("s", list(prompt), len(prompt), page_ids=list(range(16)))
    steps = [runner.prefill_logits([seq])[0]]
    for _ in range(NUM_DECODE_STEPS):
        seq.num_cached_tokens = seq.num_tokens
        seq.token_ids.append(int(steps[-1].argmax()))
        steps.append(runner.decode_logits([seq])[0])
    return torch.stack(steps), seq.token_ids


def _assert_logits_match(path: Path, device: str = "cpu") -> ModelRunner:
    runner = _runner(path, device=device)
    vocab = runner.model_config.vocab_size
    prompt = torch.randint(0, vocab, (19,), generator=torch.Generator().manual_seed(0)).tolist()
    ours, tokens = _greedy_logits(runner, prompt)
    ours = ours.cpu()
    with torch.no_grad():
        ref = _reference(path)(torch.tensor([tokens])).logits[0, len(prompt) - 1 :]
    torch.testing.assert_close(ours, ref[: NUM_DECODE_STEPS + 1], atol=2e-4, rtol=1e-4)
    return runner


# (storage type of the matrices, extra writer options)
DEMO_CASES = {
    "F32": ("F32", {}),
    "F16": ("F16", {}),
    "BF16": ("BF16", {}),
    "Q8_0": ("Q8_0", {}),
    "Q4_0": ("Q4_0", {}),
    "Q4_1-tied": ("Q4_1", {"tie": True}),  # SmolLM2's layout: the LM head reads the Q4_1 table
    "Q4_1-mixed": ("Q4_1", {"types": MIXED}),  # fused parts in different types
}


@pytest.mark.parametrize("case", list(DEMO_CASES))
def test_demo_gguf_logits_match_transformers_gguf_loading(
    case: str, demo_dir: Path, tmp_path: Path
) -> None:
    qtype, options = DEMO_CASES[case]
    _assert_logits_match(demo_gguf(demo_dir, tmp_path, qtype, **options))


@pytest.mark.parametrize(("arch", "qtype"), [("qwen2", "Q8_0"), ("qwen3", "F32")])
def test_qwen_gguf_logits_match_transformers_gguf_loading(
    arch: str, qtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen2 (QKV biases, not row-permuted) and Qwen3 (per-head q/k norms)."""
    # transformers' GGUF loader ignores attention.key_length and builds Qwen3 with its default
    # head_dim (128): the checkpoint uses that one.
    monkeypatch.setitem(ARCHS, "qwen3", ("qwen3", {"head_dim": 128, "tie_word_embeddings": True}))
    hf_dir = write_checkpoint(tmp_path / "hf", arch)
    (tmp_path / "gguf").mkdir()
    path = write_gguf(hf_dir, tmp_path / "gguf" / f"{arch}.gguf", GGMLQuantizationType[qtype])
    _assert_logits_match(path)


def test_quantized_projections_stay_packed_and_count_their_packed_bytes(
    demo_dir: Path, tmp_path: Path
) -> None:
    path = demo_gguf(demo_dir, tmp_path, "Q4_1", types=MIXED)
    runner = _runner(path)
    weights = runner.model.weights
    layer = weights.layers[0]
    assert isinstance(layer.o_proj, QuantizedTensor) and layer.o_proj.type_name == "Q4_1"
    # q, k are Q4_1 and v Q8_0: the fused QKV keeps its parts; gate (Q4_1) / up (F16) too, the
    # dense part as float32 (exact).
    assert [p.type_name for p in layer.qkv] == ["Q4_1", "Q4_1", "Q8_0"]  # type: ignore[union-attr]
    assert [p.type_name for p in layer.gate_up] == ["Q4_1", "F32"]  # type: ignore[union-attr]
    # The embedding table too stays packed (its rows are dequantized as they are looked up).
    assert isinstance(weights.embed, QuantizedTensor) and weights.embed.type_name == "Q4_1"
    reader = GGUFReader(path)
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    file_bytes += sum(
        int(t.n_elements) * 2 for t in reader.tensors if t.tensor_type.name == "F16"
    )  # the F16 part is held as float32: twice its file size
    assert weights.num_bytes == file_bytes
    # Running, 4-bit projections take well under float32 ones' memory.
    dense = _runner(demo_gguf(demo_dir, tmp_path / "f32", "F32"))
    assert runner.model.weights.num_bytes < 0.6 * dense.model.weights.num_bytes
    assert runner.weights_bytes < 0.6 * dense.weights_bytes


def test_a_quantized_gguf_runs_in_float32_on_cpu_and_a_dense_one_in_its_own_dtype(
    demo_dir: Path, demo_f32_gguf: Path, tmp_path: Path
) -> None:
    quantized = demo_gguf(demo_dir, tmp_path, "Q8_0")
    assert _runner(quantized, "auto").dtype == torch.float32
    # On CUDA the weights are dequantized at load, to bf16.
    config = load_model_config(quantized)
    assert declared_dtype(quantized, config, torch.device("cuda")) == "bfloat16"
    assert _runner(demo_gguf(demo_dir, tmp_path, "BF16"), "auto").dtype == torch.bfloat16
    assert _runner(demo_f32_gguf, "auto").dtype == torch.float32


def test_quantized_weights_are_dequantized_at_load_on_cuda(
    device: str, demo_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if device == "cpu":
        pytest.skip("CUDA's load path (CPUs keep the weights packed: tested above)")
    path = demo_gguf(demo_dir, tmp_path, "Q4_1", tie=True)
    with caplog.at_level(logging.INFO, logger="pdserve.model.gguf.weights"):
        runner = _assert_logits_match(path, device)
    layer = runner.model.weights.layers[0]
    assert isinstance(layer.qkv, torch.Tensor) and layer.qkv.device.type == "cuda"
    assert runner.model.weights.lm_head is runner.model.weights.embed
    assert "quantized matrices dequantized to torch.float32 at load" in caplog.text


def test_unpermute_rows_undoes_llama_cpp_s_rotary_row_order() -> None:
    heads, head_dim = 3, 8
    rows = np.arange(heads * head_dim * 2, dtype=np.float32).reshape(heads * head_dim, 2)
    permuted = _permute(rows, heads)
    assert not np.array_equal(permuted, rows)
    np.testing.assert_array_equal(permuted[unpermute_rows(heads, head_dim)], rows)
