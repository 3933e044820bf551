"""RMSNorm equals the formula (float32 statistics even for bf16); the fused kernels equal torch."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.rmsnorm import add_rms_norm_, rms_norm


def test_rms_norm_matches_formula() -> None:
    x, w = torch.randn(3, 16), torch.randn(16)
    expected = w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), expected)


def test_bfloat16_statistics_are_computed_in_float32() -> None:
    x = (torch.randn(4, 64) * 300).to(torch.bfloat16)  # squares overflow bf16 precision badly
    w = torch.ones(64, dtype=torch.bfloat16)
    out = rms_norm(x, w, 1e-6)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(
        torch.bfloat16
    )
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


needs_kernel = pytest.mark.usefixtures("cpu_kernels")  # skips where the kernels cannot run


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1024), (8, 256), (300, 200), (5, 3)])
def test_kernel_matches_torch_rms_norm(
    cpu_kernels: types.ModuleType, dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    gen = torch.Generator().manual_seed(shape[0] * shape[1])
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    w = torch.randn(shape[1], generator=gen).to(dtype)
    out = cpu_kernels.rms_norm(x, w, 1e-5)
    expected = F.rms_norm(x, (shape[1],), w, 1e-5)
    assert out.dtype == dtype
    # float32 sums in another order; bf16 may differ by one rounding step at most.
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0, "rtol": 8e-3}
    torch.testing.assert_close(out, expected, **tol)


@needs_kernel
def test_per_head_norm_of_a_strided_projection_slice() -> None:
    """Qwen3's q_norm: rows are (token, head) pairs of a view inside the fused QKV output."""
    fused = torch.randn(6, 4 + 2 * 2, 32).bfloat16()
    q = fused[:, :4]  # (T, heads, head_dim), not contiguous
    w = torch.randn(32).bfloat16()
    out = rms_norm(q, w, 1e-6)
    assert out.shape == q.shape
    torch.testing.assert_close(out, F.rms_norm(q, (32,), w, 1e-6), atol=0, rtol=8e-3)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_updates_the_residual_in_place_like_the_two_step_form(
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(7, 264, generator=gen).to(dtype)
    x = torch.randn(7, 264, generator=gen).to(dtype)
    w = torch.randn(264, generator=gen).to(dtype)
    expected_h = h + x  # torch's add rounds to dtype, as the kernel must
    expected = F.rms_norm(expected_h, (264,), w, 1e-6)
    storage = h.data_ptr()
    out = add_rms_norm_(h, x, w, 1e-6)
    assert h.data_ptr() == storage and torch.equal(h, expected_h)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0, "rtol": 8e-3}
    torch.testing.assert_close(out, expected, **tol)


def test_fused_add_falls_back_to_torch_for_other_dtypes() -> None:
    h, x, w = torch.randn(3, 16).half(), torch.randn(3, 16).half(), torch.ones(16).half()
    expected_h = h + x
    out = add_rms_norm_(h, x, w, 1e-6)
    assert torch.equal(h, expected_h)
    torch.testing.assert_close(out, F.rms_norm(expected_h, (16,), w, 1e-6))


@needs_kernel
def test_a_row_has_the_same_bits_at_every_row_count() -> None:
    """Alone, among 3 or 8 decode rows, in a 64-row chunk and a 300-row prompt (where the
    kernel splits rows between threads): one result per row, fused add included."""
    torch.manual_seed(0)
    w, row, delta = torch.randn(576), torch.randn(1, 576), torch.randn(1, 576)
    alone = rms_norm(row, w, 1e-5)
    alone_fused = add_rms_norm_(row.clone(), delta, w, 1e-5)
    for num_rows in (3, 8, 64, 300):
        at = num_rows // 2
        batch, deltas = torch.randn(num_rows, 576), torch.randn(num_rows, 576)
        batch[at], deltas[at] = row[0], delta[0]
        assert torch.equal(rms_norm(batch, w, 1e-5)[at], alone[0]), num_rows
        assert torch.equal(add_rms_norm_(batch, deltas, w, 1e-5)[at], alone_fused[0]), num_rows
