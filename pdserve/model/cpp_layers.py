"""A model's decoder layers as one C++ call (csrc/decoder_stack.cpp), where every piece of every
layer already runs a C++ CPU kernel.

The C++ loop calls the kernels the Python loop of :class:`~pdserve.model.llama.LlamaModel`
calls, in the same order, on the same operands, so a token's bits are the same either way
(tests/model/test_cpp_layers.py). It exists for speed only: a small model's decode step is ~300
kernel calls, and the interpreter and torch's dispatch between them cost about a millisecond.
Chosen once per (model, attention backend) pair: float32 activations, projections held by the
kernels (GGUF-quantized or dense bf16/float32), the C++ attention backend, no per-head q/k norm
(Qwen3 keeps the Python loop). A mixed prefill+decode step also keeps it (its attention runs
as two calls).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from pdserve.attention.backend import AttentionBackend
from pdserve.attention.cpp_backend import CppAttentionBackend
from pdserve.kernels import cpu_ext
from pdserve.kernels.linear import Linear
from pdserve.model.config import ModelConfig
from pdserve.model.forward_batch import ForwardBatch
from pdserve.parallel.row_parallel import RowParallelLinear


class LayerParts(Protocol):
    """What the stack reads of a model layer (model/llama.py's _Layer)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: Linear
    o_proj: Linear | RowParallelLinear
    gate_up: Linear
    down: Linear | RowParallelLinear


class CppDecoderLayers:
    """The C++ stack built from a model's layers and a backend's per-layer pool views."""

    def __init__(
        self, module: types.ModuleType, cfg: ModelConfig, layers: Sequence[LayerParts],
        attn: CppAttentionBackend,
    ) -> None:  # fmt: skip
        self._attn = attn
        stack = module.DecoderStack()
        stack.layers = [_layer(module, layer) for layer in layers]
        stack.pools = attn.layer_pools
        stack.num_heads, stack.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        stack.head_dim, stack.sliding_window = cfg.head_dim, attn.config.sliding_window or 0
        stack.scale, stack.eps = attn.config.scale, cfg.rms_norm_eps
        self._stack = stack

    def run(
        self, h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        batch: ForwardBatch,
    ) -> bool:  # fmt: skip
        """Every layer over ``h`` in place (``x``: layer 0's normed input); False (nothing
        done) where the batch needs the Python loop."""
        rows = self._attn.kernel_rows(batch)
        if rows is None:
            return False
        self._stack.forward_(h, x, cos, sin, batch.block_table, *rows)
        return True


def uses_cpp_stack(
    device: torch.device, layers: Sequence[LayerParts], act_dtype: torch.dtype,
    attn: AttentionBackend,
) -> bool:  # fmt: skip
    """Whether the C++ stack can run this model: decided from the model's device and parts
    alone, before anything loads the C++ CPU module (a CUDA run never builds it)."""
    return (
        device.type == "cpu"
        and isinstance(attn, CppAttentionBackend)
        and act_dtype == torch.float32  # the rope tables' and norms' dtype too
        and all(
            layer.q_norm is None
            and layer.k_norm is None
            and all(_is_kernel(p) for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
            for layer in layers
        )
    )


def cpp_decoder_layers(
    cfg: ModelConfig, layers: Sequence[LayerParts], act_dtype: torch.dtype,
    attn: AttentionBackend, device: torch.device,
) -> CppDecoderLayers | None:  # fmt: skip
    """The C++ stack where it computes exactly what the Python loop would, else None."""
    if not uses_cpp_stack(device, layers, act_dtype, attn):
        return None
    module = cpu_ext.load()
    if module is None:
        return None
    assert isinstance(attn, CppAttentionBackend)
    return CppDecoderLayers(module, cfg, layers, attn)


def _is_kernel(p: Linear | RowParallelLinear) -> bool:
    """A projection C++ kernels hold: a plain one, or a row-parallel sum of one rank alone (a
    TP1 model's segmented sum; with a group, the Python loop runs its collectives)."""
    if isinstance(p, RowParallelLinear):
        return p.group is None and all(_is_kernel(piece) for piece in p.pieces)
    return p.quant is not None or p.kernel is not None


def _layer(module: types.ModuleType, layer: LayerParts) -> Any:
    out = module.DecoderLayer()
    out.qkv, out.o_proj = _projection(module, layer.qkv), _projection(module, layer.o_proj)
    out.gate_up, out.down = _projection(module, layer.gate_up), _projection(module, layer.down)
    out.input_norm, out.post_norm = layer.input_norm, layer.post_norm
    return out


def _projection(module: types.ModuleType, p: Linear | RowParallelLinear) -> Any:
    out = module.Projection()
    if isinstance(p, RowParallelLinear):
        out.segments = [_projection(module, piece) for piece in p.pieces]
        out.bounds = [b for bounds in p.segments for b in bounds]
        out.bias = p.bias
        return out
    if p.quant is not None:
        out.packed, out.types, out.ns = p.quant.packed, p.quant.type_ids, p.quant.part_sizes
        out.out_features = p.quant.out_features
    else:
        assert p.kernel is not None
        out.dense, out.out_features = p.kernel.packed, p.kernel.out_features
    out.bias = p.bias
    return out
