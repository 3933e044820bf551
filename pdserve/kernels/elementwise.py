"""Per-token elementwise steps of a decoder layer as single C++ kernels, with torch fallbacks.

Rotary embeddings (in place, see :func:`pdserve.kernels.rope.apply_rope` for the convention)
and SiLU-gated products are each a chain of three to five small torch operators; on a decode
step's few rows their dispatch costs more than the arithmetic. The kernels (csrc/
elementwise.cpp) compute in float32 and round once, where torch rounds after every operator, so
bf16 results may differ from the torch path by one rounding step.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_ext
from pdserve.kernels.rope import apply_rope

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _kernel_for(x: torch.Tensor) -> types.ModuleType | None:
    if x.device.type != "cpu" or x.dtype not in _KERNEL_DTYPES or x.stride(-1) != 1:
        return None
    return cpu_ext.load()


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(T, heads, head_dim)`` (any row strides) in place by per-token tables
    ``(T, head_dim)`` from :func:`~pdserve.kernels.rope.rope_tables`; returns ``x``."""
    module = _kernel_for(x)
    is_supported = (
        x.dim() == 3
        and x.shape[-1] % 16 == 0
        and cos.dtype == signed_sin.dtype == x.dtype
        and cos.is_contiguous()
        and signed_sin.is_contiguous()
    )
    if module is not None and is_supported:
        module.rope_(x, cos, signed_sin)
        return x
    return apply_rope(x, cos, signed_sin, out=x)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused ``(T, 2 * inter)`` projection output ``[gate | up]``."""
    module = _kernel_for(gate_up)
    if module is not None and gate_up.dim() == 2:
        return module.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
