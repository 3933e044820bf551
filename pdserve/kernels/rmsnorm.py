"""RMSNorm (Zhang & Sennrich, 2019): ``x / rms(x) * weight``, statistics in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise the last dim of ``x`` and scale by ``weight``, in one fused kernel.

    torch's kernel accumulates the mean square in float32 for bf16/fp16 inputs; it rounds once
    (after scaling) where the Hugging Face reference rounds before scaling too.
    """
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add followed by RMSNorm; returns ``(normed, new_residual)``."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual
