"""RMSNorm equals the formula, computed in float32 even for bfloat16 inputs."""

from __future__ import annotations

import torch

from pdserve.kernels.rmsnorm import add_rms_norm, rms_norm


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


def test_add_rms_norm_returns_the_new_residual() -> None:
    x, r, w = torch.randn(2, 8), torch.randn(2, 8), torch.ones(8)
    normed, residual = add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(residual, x + r)
    torch.testing.assert_close(normed, rms_norm(x + r, w, 1e-6))
