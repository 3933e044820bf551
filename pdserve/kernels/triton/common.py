"""Shared pieces of the Triton attention kernels: block sizes and the dot precision."""

from __future__ import annotations

import torch
import triton

# Softmax runs in base 2 (exp2 is the native instruction): scores are pre-scaled by log2(e).
LOG2E = 1.4426950408889634


def head_block(head_dim: int) -> int:
    """The head dimension padded to a power of two (tl.arange needs one), at least 16 (tl.dot)."""
    return max(16, triton.next_power_of_2(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    """float32 models get exact float32 dots (TF32 would break parity with the torch reference);
    bf16/fp16 operands are exact in any mode."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dots(q: torch.Tensor, layer_pool: torch.Tensor) -> bool:
    """Whether the kernels cast the dot operands to float32 first: on the CPU, where they run
    in Triton's interpreter, whose ``tl.dot`` multiplies bf16 operands' raw bits (the products
    are exact either way: bf16 x bf16 fits float32, so the numerics are the GPU's), and where
    the queries' dtype is not the cache's (float32 activations over a bf16 cache: ``tl.dot``
    takes two operands of one dtype)."""
    return q.device.type == "cpu" or q.dtype != layer_pool.dtype
