"""Fused rope and SiLU-gate kernels equal the torch operator chains they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.elementwise import rope_, silu_mul
from pdserve.kernels.rope import apply_rope, rope_tables

needs_kernel = pytest.mark.usefixtures("cpu_kernels")  # skips where the kernels cannot run
# bf16: the kernel rounds once, torch after each operator: at most a rounding step apart.
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2},
}


def _tables(positions: torch.Tensor, head_dim: int, dtype: torch.dtype):
    cos, sin = rope_tables(64, head_dim, 10000.0, None, dtype)
    return cos[positions], sin[positions]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rope_in_place_on_a_strided_slice_matches_apply_rope(
    dtype: torch.dtype, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    fused = torch.randn(5, 4 + 2 * 2, head_dim, generator=gen).to(dtype)  # q | k | v heads
    untouched = fused[:, 6:].clone()
    cos, sin = _tables(torch.tensor([0, 3, 7, 8, 63]), head_dim, dtype)
    expected = apply_rope(fused[:, :6].clone(), cos, sin)
    qk = fused[:, :6]
    assert rope_(qk, cos, sin) is qk
    torch.testing.assert_close(fused[:, :6], expected, **TOLERANCE[dtype])
    assert torch.equal(fused[:, 6:], untouched)


def test_rope_falls_back_to_torch_for_odd_head_dims() -> None:
    x = torch.randn(3, 2, 8)
    cos, sin = _tables(torch.tensor([1, 2, 3]), 8, torch.float32)
    expected = apply_rope(x.clone(), cos, sin)
    torch.testing.assert_close(rope_(x, cos, sin), expected)
    torch.testing.assert_close(x, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 512), (8, 5632), (3, 22)])
def test_silu_mul_matches_torch(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(shape[1])
    gate_up = (torch.randn(*shape, generator=gen) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    out = silu_mul(gate_up)
    assert out.dtype == dtype and out.shape == (shape[0], shape[1] // 2)
    expected = (F.silu(gate.float()) * up.float()).to(dtype)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
