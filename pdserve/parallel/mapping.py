"""Which slice of every weight a tensor-parallel rank holds: the shard math, in one place.

Rank ``r`` of ``t`` owns query heads ``[r*H/t, (r+1)*H/t)``, its KV heads (split where
``t <= Hkv``, one replicated head where ``t > Hkv``: :func:`kv_heads_of_rank`) and intermediate
columns ``[r*I/t, (r+1)*I/t)``. Column-parallel projections (fused QKV, gate/up) keep the rows
of those outputs; row-parallel ones (o_proj, down) keep the columns of those inputs.

The same tokens at every TP size: a row-parallel projection sums its K dimension in
:func:`reduction_segments` fixed segments, at TP1 too, and the segment partials are combined in
one balanced tree (:mod:`pdserve.parallel.row_parallel`). Rank ``r`` holds segments
``[r*S/t, (r+1)*S/t)``, so its local subtree is a subtree of the TP1 tree and the result has
the same bits at every ``t`` dividing ``S``. A segment whose bounds fall inside a quantized block
(Qwen2.5-0.5B's 4864-wide down projection at two segments cuts a 256-wide Q4_K superblock) keeps
the whole covering blocks, unchanged, and reads zeros outside its range: a weight times zero
adds exactly nothing, so no block is dequantized or requantized and the operands a segment's
kernel call sees are the same at every TP size.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from pdserve.model.config import ModelConfig
from pdserve.model.quantized import QuantizedTensor
from pdserve.model.weights import Projection, projection_parts
from pdserve.parallel.plan import check_tp_kv_heads, kv_heads_of_rank

MAX_SEGMENTS = 8  # the largest TP size a checkpoint's TP1 numerics prepare for


def _largest_power_of_two_dividing(n: int, limit: int) -> int:
    p = 1
    while p * 2 <= limit and n % (p * 2) == 0:
        p *= 2
    return p


def reduction_segments(cfg: ModelConfig) -> int:
    """The fixed number of K segments of every row-parallel sum: the largest power of two (up
    to :data:`MAX_SEGMENTS`) this model's heads, KV heads and MLP split into. Every TP size the
    model can run at divides it. 1 (today's single fused sum) for a model that cannot split in
    two, such as SmolLM2-135M's 9 heads."""
    s = _largest_power_of_two_dividing(cfg.num_heads, MAX_SEGMENTS)
    s = min(s, _largest_power_of_two_dividing(cfg.intermediate_size, MAX_SEGMENTS))
    while s > 1 and not _kv_heads_split(s, cfg.num_kv_heads):
        s //= 2
    return s


def _kv_heads_split(tp_size: int, num_kv_heads: int) -> bool:
    try:
        check_tp_kv_heads(tp_size, num_kv_heads)
    except ValueError:
        return False
    return True


def check_tp_size(cfg: ModelConfig, tp_size: int) -> None:
    """ValueError unless ``tp_size`` ranks split this model exactly (and bit-identically)."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    segments = reduction_segments(cfg)
    if segments % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not split this model: {cfg.num_heads} heads, "
            f"{cfg.num_kv_heads} KV heads and intermediate size {cfg.intermediate_size} split "
            f"into at most {segments} (a power of two dividing the heads and the MLP, with the "
            "KV heads split evenly or replicated evenly)"
        )


def local_config(cfg: ModelConfig, tp_size: int, rank: int) -> ModelConfig:
    """The model as rank ``rank`` sees it: its heads and KV heads (the attention backend and
    the forward pass read these); its MLP width is nominal (a layer's share follows that
    layer's block bounds, :func:`mlp_bounds`)."""
    if tp_size == 1:
        return cfg
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // tp_size,
        num_kv_heads=len(kv_heads_of_rank(rank, tp_size, cfg.num_kv_heads)),
        intermediate_size=cfg.intermediate_size // tp_size,
    )


def qkv_rows(cfg: ModelConfig, tp_size: int, rank: int) -> list[tuple[int, int]]:
    """The rank's row ranges of the fused ``[q; k; v]`` projection, in the order it keeps them."""
    d, q_heads = cfg.head_dim, cfg.num_heads // tp_size
    kv = kv_heads_of_rank(rank, tp_size, cfg.num_kv_heads)
    q0, k0, v0 = 0, cfg.num_heads * d, (cfg.num_heads + cfg.num_kv_heads) * d
    return [
        (q0 + rank * q_heads * d, q0 + (rank + 1) * q_heads * d),
        (k0 + kv.start * d, k0 + kv.stop * d),
        (v0 + kv.start * d, v0 + kv.stop * d),
    ]


def mlp_bounds(intermediate: int, num_segments: int, block: int) -> list[int]:
    """The MLP's segment bounds: nearly equal and on ``block`` boundaries (the down
    projection's quantized block), so no down segment cuts a block. The MLP splits at any
    column (gate/up are column-parallel), so a rank's share may be a block wider than another's;
    equal widths where ``block`` does not divide the MLP or it has fewer blocks than segments
    (the segments then cut blocks: :func:`row_segments` pads them)."""
    if intermediate % block or intermediate // block < num_segments:
        block = 1
    blocks = intermediate // block
    return [j * blocks // num_segments * block for j in range(num_segments)] + [intermediate]


def gate_up_rows(
    cfg: ModelConfig, tp_size: int, rank: int, bounds: list[int] | None = None
) -> list[tuple[int, int]]:
    """The rank's row ranges of the fused ``[gate; up]`` projection: its share of the MLP
    segments ``bounds`` (:func:`mlp_bounds`; default: equal shares)."""
    inter = cfg.intermediate_size
    bounds = bounds or [inter * j // tp_size for j in range(tp_size + 1)]
    per_rank = (len(bounds) - 1) // tp_size
    lo, hi = bounds[rank * per_rank], bounds[(rank + 1) * per_rank]
    return [(lo, hi), (inter + lo, inter + hi)]


def take_rows(weight: Projection, ranges: list[tuple[int, int]]) -> Projection:
    """The rows ``ranges`` of a projection, stacked in that order (quantized rows move as whole
    blocks; parts of a mixed-type projection stay separate parts)."""
    if isinstance(weight, torch.Tensor):
        return torch.cat([weight[a:b] for a, b in ranges]).contiguous()
    picked: list[QuantizedTensor] = []
    for a, b in ranges:
        start = 0
        for part in projection_parts(weight):
            assert isinstance(part, QuantizedTensor)
            stop = start + part.shape[0]
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                picked.append(part.take_rows(torch.arange(lo - start, hi - start)))
            start = stop
    return picked[0] if len(picked) == 1 else picked


def take_vector(v: torch.Tensor | None, ranges: list[tuple[int, int]]) -> torch.Tensor | None:
    """A bias's entries for the rows ``ranges`` (None stays None)."""
    return None if v is None else torch.cat([v[a:b] for a, b in ranges])


@dataclass
class KSegment:
    """One segment of a row-parallel sum: ``weight`` covers the segment's input columns
    widened to whole quantized blocks; the segment reads local input columns ``[lo, hi)`` with
    ``pad_before`` zeros in front and ``pad_after`` behind (0 for dense weights)."""

    weight: Projection
    lo: int
    hi: int
    pad_before: int = 0
    pad_after: int = 0


def block_size(weight: Projection) -> int:
    """The elements of K one quantized block of ``weight`` covers (the lcm over its parts; 1
    for a dense weight)."""
    if isinstance(weight, torch.Tensor):
        return 1
    return math.lcm(*(p.block_size for p in projection_parts(weight)))  # type: ignore[union-attr]


def _columns(weight: Projection, a: int, b: int) -> Projection:
    """Input columns ``[a, b)`` (whole blocks) of every row."""
    if isinstance(weight, torch.Tensor):
        return weight[:, a:b].contiguous()
    parts = [p.take_columns(a, b) for p in projection_parts(weight)]  # type: ignore[union-attr]
    return parts[0] if len(parts) == 1 else parts


def row_segments(
    weight: Projection, in_features: int, num_segments: int, tp_size: int, rank: int,
    bounds: list[int] | None = None,
) -> list[KSegment]:  # fmt: skip
    """Rank ``rank``'s segments of a row-parallel projection of ``in_features`` inputs, in
    order; ``lo``/``hi`` are columns of the rank's own input slice. ``bounds``: the segments'
    global bounds (default: equal widths, ``in_features / num_segments``); the rank's slice
    starts at its first segment's."""
    if num_segments % tp_size or (bounds is None and in_features % num_segments):
        raise ValueError(f"{in_features} inputs in {num_segments} segments over {tp_size} ranks")
    if bounds is None:
        bounds = [in_features * j // num_segments for j in range(num_segments + 1)]
    per_rank = num_segments // tp_size
    block, base = block_size(weight), bounds[rank * per_rank]
    out = []
    for s in range(rank * per_rank, (rank + 1) * per_rank):
        g0, g1 = bounds[s], bounds[s + 1]
        c0, c1 = g0 // block * block, -(-g1 // block) * block
        out.append(KSegment(_columns(weight, c0, c1), g0 - base, g1 - base, g0 - c0, c1 - g1))
    return out
