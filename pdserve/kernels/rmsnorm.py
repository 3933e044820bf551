"""RMSNorm (Zhang & Sennrich, 2019): ``x / rms(x) * weight``, statistics in float32.

Where the C++ CPU kernels run (:mod:`pdserve.kernels.cpu_ext`), float32 and bf16 rows go
through one fused kernel (csrc/rmsnorm.cpp) instead of torch's chain of small operators;
elsewhere (other dtypes, devices, layouts, no compiler) torch computes the same thing.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_ext

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _kernel_for(x: torch.Tensor, weight: torch.Tensor) -> types.ModuleType | None:
    """The kernel module if it handles these rows (2-D or 3-D, contiguous last dim)."""
    is_supported = (
        x.device.type == "cpu"
        and x.dtype in _KERNEL_DTYPES
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and x.dim() in (2, 3)
        and x.stride(-1) == 1
    )
    return cpu_ext.load() if is_supported else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise the last dim of ``x`` and scale by ``weight``, in one fused kernel.

    The mean square is accumulated in float32 for bf16 inputs, and the result rounds once
    (after scaling), like torch's kernel; the Hugging Face reference rounds before scaling too.
    """
    module = _kernel_for(x, weight)
    if module is not None:
        return module.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm_(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` in place, then the RMSNorm of the new residual (returned).

    One kernel for a decoder layer's ``h += sublayer(...)`` and the next norm; the sum is
    rounded to the residual's dtype before the norm reads it, exactly like the two-step form.
    """
    module = _kernel_for(residual, weight)
    is_same_layout = x.dtype == residual.dtype and x.shape == residual.shape and x.stride(-1) == 1
    if module is not None and is_same_layout:
        return module.add_rms_norm_(residual, x, weight, eps)
    residual += x
    return rms_norm(residual, weight, eps)
