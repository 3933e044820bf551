"""Projections that pick the fastest CPU matmul for the number of rows.

On CPUs without native bf16 matrix instructions (AVX2 only), torch's bf16 matmul is fast as
a matrix-vector product (it is bound by reading the weights, and bf16 halves that) but several
times slower than MKL's float32 GEMM once a handful of rows share the weights. A projection may
therefore keep a float32 copy of its weight and use it from ``fp32_min_rows`` rows on; the
result is cast back, so callers only ever see the model dtype.

The float32 copy is packed once into oneDNN's blocked layout where oneDNN is available: on AMD
CPUs, MKL's float32 GEMM takes a generic path, and oneDNN's packed GEMM is measured ~1.7-2x faster
at 8 rows (1024 x 5632: 2.0 ms vs 3.3-4.1 ms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """``y = x @ weight.T + bias`` with an optional float32 path for many-row inputs."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        fp32_min_rows: int | None = None,
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.fp32_min_rows = fp32_min_rows
        self.weight_f32: torch.Tensor | None = None
        self.bias_f32: torch.Tensor | None = None
        self.is_packed = False
        if fp32_min_rows is not None and weight.dtype != torch.float32:
            self.weight_f32 = weight.float()
            self.bias_f32 = bias.float() if bias is not None else None
            if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
                self.weight_f32 = torch.ops.mkldnn._reorder_linear_weight(self.weight_f32, None)
                self.is_packed = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_f32 is not None and x.shape[0] >= self.fp32_min_rows:  # type: ignore[operator]
            return self._linear_f32(x.float()).to(x.dtype)
        return F.linear(x, self.weight, self.bias)

    def _linear_f32(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_packed:
            return F.linear(x, self.weight_f32, self.bias_f32)
        rows = x.reshape(-1, x.shape[-1])  # (N, in)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.weight_f32, self.bias_f32, "none", [], "")
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @property
    def num_extra_bytes(self) -> int:
        """Memory held by the float32 copies (0 without them)."""
        tensors = [t for t in (self.weight_f32, self.bias_f32) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def has_fast_bf16_matmul(device: torch.device) -> bool:
    """True where bf16 GEMM runs on native instructions (CUDA, or AVX512-BF16 / AMX CPUs)."""
    if device.type != "cpu":
        return True
    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2")
