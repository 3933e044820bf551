"""The shard math: every rank's slices put back together are the whole weight, and the fixed
reduction segments every TP size shares."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pdserve.model.config import ModelConfig
from pdserve.model.quantized import QuantizedTensor
from pdserve.parallel.mapping import (
    KSegment,
    check_tp_size,
    gate_up_rows,
    local_config,
    mlp_bounds,
    qkv_rows,
    reduction_segments,
    row_segments,
    take_rows,
    take_vector,
)
from pdserve.parallel.plan import kv_heads_of_rank
from pdserve.parallel.row_parallel import tree_sum
from tests.kernels.test_quant_gemm import random_weight

BASE = ModelConfig(
    architecture="Qwen2ForCausalLM", vocab_size=320, hidden_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e4,
    rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=True,
)  # fmt: skip


def _cfg(**kw: int) -> ModelConfig:
    return dataclasses.replace(BASE, **kw)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "inter", "segments"),
    [
        (9, 3, 1536, 1),  # SmolLM2-135M: 9 heads do not split in two
        (14, 2, 4864, 2),  # Qwen2.5-0.5B
        (12, 2, 8960, 4),  # Qwen2.5-1.5B
        (32, 8, 14336, 8),  # Llama-3-8B
        (4, 2, 512, 4),  # the demo model
        (8, 1, 512, 8),  # one KV head, replicated at every size
        (4, 3, 512, 1),  # 3 KV heads neither split nor replicate evenly in powers of two
    ],
)
def test_reduction_segments_are_the_largest_power_of_two_the_model_splits_into(
    heads: int, kv_heads: int, inter: int, segments: int
) -> None:
    cfg = _cfg(num_heads=heads, num_kv_heads=kv_heads, intermediate_size=inter)
    assert reduction_segments(cfg) == segments
    for t in (1, 2, 4, 8):
        if segments % t == 0:
            check_tp_size(cfg, t)
        else:
            with pytest.raises(ValueError, match=f"tensor_parallel_size {t} does not split"):
                check_tp_size(cfg, t)


def _qkv_weight(cfg: ModelConfig) -> torch.Tensor:
    rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return torch.arange(rows * 8, dtype=torch.float32).reshape(rows, 8)


@pytest.mark.parametrize(("kv_heads", "tp"), [(2, 2), (2, 4), (1, 2), (1, 4), (4, 2), (4, 4)])
def test_qkv_shards_hold_each_rank_s_heads_and_together_every_head(kv_heads: int, tp: int) -> None:
    cfg = _cfg(num_kv_heads=kv_heads)
    w, d = _qkv_weight(cfg), cfg.head_dim
    k0, v0 = cfg.num_heads * d, (cfg.num_heads + kv_heads) * d

    def heads(start: int, ids: range) -> torch.Tensor:
        return torch.cat([w[start + h * d : start + (h + 1) * d] for h in ids])

    seen_q: list[int] = []
    seen_kv: set[int] = set()
    for r in range(tp):
        shard = take_rows(w, qkv_rows(cfg, tp, r))
        lc, kv = local_config(cfg, tp, r), kv_heads_of_rank(r, tp, kv_heads)
        q = range(r * lc.num_heads, (r + 1) * lc.num_heads)
        assert isinstance(shard, torch.Tensor)
        assert torch.equal(shard, torch.cat([heads(0, q), heads(k0, kv), heads(v0, kv)]))
        assert lc.num_kv_heads == len(kv)
        seen_q += list(q)
        seen_kv |= set(kv)
    assert seen_q == list(range(cfg.num_heads)) and seen_kv == set(range(kv_heads))


def test_gate_up_shards_and_their_biases_reassemble_gate_and_up() -> None:
    cfg, tp = BASE, 4
    w = torch.randn(2 * cfg.intermediate_size, 8)
    bias = torch.randn(2 * cfg.intermediate_size)
    shards = [take_rows(w, gate_up_rows(cfg, tp, r)) for r in range(tp)]
    biases = [take_vector(bias, gate_up_rows(cfg, tp, r)) for r in range(tp)]
    width = cfg.intermediate_size // tp
    gate = torch.cat([s[:width] for s in shards])  # type: ignore[index]
    up = torch.cat([s[width:] for s in shards])  # type: ignore[index]
    assert torch.equal(torch.cat([gate, up]), w)
    assert torch.equal(torch.cat([b[:width] for b in biases] + [b[width:] for b in biases]), bias)  # type: ignore[index]


def _quantized(kind: str, n: int, k: int) -> QuantizedTensor:
    return random_weight(kind, n, k, seed=0)


def test_quantized_rows_move_as_whole_blocks_across_mixed_type_parts() -> None:
    parts = [_quantized("Q4_K", 6, 256), _quantized("Q6_K", 4, 256)]
    full = torch.cat([p.dequantize() for p in parts])
    picked = take_rows(parts, [(2, 5), (5, 8)])
    picked_parts = picked if isinstance(picked, list) else [picked]
    assert [p.type_name for p in picked_parts] == ["Q4_K", "Q4_K", "Q6_K"]
    assert torch.equal(torch.cat([p.dequantize() for p in picked_parts]), full[2:8])


def _segment_columns(seg: KSegment) -> torch.Tensor:
    """The segment's own input columns of its (block-widened) weight, dense."""
    w = seg.weight
    dense = w if isinstance(w, torch.Tensor) else torch.cat(
        [p.dequantize() for p in (w if isinstance(w, list) else [w])]
    )  # fmt: skip
    return dense[:, seg.pad_before : dense.shape[1] - seg.pad_after]


@pytest.mark.parametrize(
    ("kind", "k", "segments"),
    [("F32", 128, 4), ("Q8_0", 256, 8), ("Q4_K", 4864, 2), ("Q4_K", 1536, 4), ("Q6_K", 512, 8)],
)
@pytest.mark.parametrize("tp", [1, 2])
def test_row_segments_reassemble_the_weight_and_cut_blocks_are_kept_whole(
    kind: str, k: int, segments: int, tp: int
) -> None:
    weight: torch.Tensor | QuantizedTensor
    if kind == "F32":
        weight, full = torch.randn(8, k), None
    else:
        weight = _quantized(kind, 8, k)
        full = weight.dequantize()
    per_rank = [row_segments(weight, k, segments, tp, r) for r in range(tp)]
    cols = torch.cat([_segment_columns(s) for segs in per_rank for s in segs], dim=1)
    assert torch.equal(cols, weight if full is None else full)
    block = GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]
    width = k // tp
    for segs in per_rank:
        assert segs[0].lo == 0 and segs[-1].hi == width  # the rank's own input slice
        for s in segs:
            assert (s.pad_before + s.hi - s.lo + s.pad_after) % block == 0
            assert s.pad_before < block and s.pad_after < block


@pytest.mark.parametrize(("inter", "segments"), [(4864, 2), (8960, 4), (4096, 8)])
def test_mlp_segments_fall_on_block_bounds_so_the_down_projection_cuts_no_block(
    inter: int, segments: int
) -> None:
    bounds = mlp_bounds(inter, segments, 256)
    assert bounds[0] == 0 and bounds[-1] == inter and all(b % 256 == 0 for b in bounds)
    widths = [b - a for a, b in itertools.pairwise(bounds)]
    assert max(widths) - min(widths) <= 256  # nearly even: at most one block apart
    down = random_weight("Q4_K", 4, inter, seed=1)
    for tp in (1, 2):
        if segments % tp:
            continue
        per_rank = [row_segments(down, inter, segments, tp, r, bounds) for r in range(tp)]
        assert all(s.pad_before == s.pad_after == 0 for segs in per_rank for s in segs)
        cols = torch.cat([_segment_columns(s) for segs in per_rank for s in segs], dim=1)
        assert torch.equal(cols, down.dequantize())
        cfg = _cfg(intermediate_size=inter)
        gate = [gate_up_rows(cfg, tp, r, bounds)[0] for r in range(tp)]
        assert [hi - lo for lo, hi in gate] == [segs[-1].hi for segs in per_rank]


def test_tree_sum_adds_in_one_fixed_pairwise_order() -> None:
    a, b, c, d = (torch.tensor([v], dtype=torch.float32) for v in (1e8, 1.0, -1e8, 1.0))
    assert tree_sum([a, b, c, d]).item() == ((a + b) + (c + d)).item()
    with pytest.raises(ValueError, match="power-of-two"):
        tree_sum([a, b, c])
