"""Projections that pick the fastest CPU matmul for the number of rows.

On CPUs without native bf16 matrix instructions (AVX2 only), torch's bf16 matmul re-reads and
converts the weights per row. Two paths replace it:

- few rows (decode): :mod:`pdserve.kernels.cpu_gemm`, a kernel that streams each packed bf16
  weight once per call for all rows and accumulates in float32 (memory bound at one row,
  ~2x torch's bf16 matmul on "small"-sized models at 1-8 rows);
- many rows (prefill, from ``fp32_min_rows``): a float32 copy of the weight packed once into
  oneDNN's blocked layout (on AMD CPUs MKL's float32 GEMM takes a generic path; oneDNN's packed
  GEMM is ~1.7-2x faster).

Results are cast back, so callers only ever see the model dtype.

GGUF-quantized weights (a :class:`~pdserve.model.quantized.QuantizedTensor`, or a list of them
stacked along N) stay packed for :mod:`pdserve.kernels.quant_gemm` (float32 in and out, cast
back) where the C++ module runs; elsewhere they are dequantized once, to ``dtype`` (the model's),
and that dense copy counts in ``num_extra_bytes``.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_ext, cpu_gemm, quant_gemm
from pdserve.model.quantized import QuantizedTensor

logger = logging.getLogger(__name__)


class Linear:
    """``y = x @ weight.T + bias``, routed by row count (see the module docstring).

    ``use_kernel``: pack the weight for the bf16 CPU kernel where it runs (bf16 on AVX2 CPUs).
    """

    def __init__(
        self,
        weight: torch.Tensor | QuantizedTensor | list[QuantizedTensor],
        bias: torch.Tensor | None = None,
        fp32_min_rows: int | None = None,
        use_kernel: bool = True,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.quant: quant_gemm.PackedQuantWeight | None = None
        self.num_dequantized_bytes = 0
        if isinstance(weight, (QuantizedTensor, list)):
            parts = [weight] if isinstance(weight, QuantizedTensor) else weight
            self.quant = quant_gemm.pack_parts(parts) if use_kernel else None
            if self.quant is not None:  # no dense weight is kept
                self.bias = bias.float() if bias is not None else None
                self.fp32_min_rows, self.weight_f32, self.bias_f32 = None, None, None
                self.kernel, self.is_packed = None, False
                return
            _log_dequantized_once(dtype)
            weight = torch.cat([p.dequantize(dtype) for p in parts])
            self.num_dequantized_bytes = weight.numel() * weight.element_size()
        self.weight = weight
        self.bias = bias
        self.fp32_min_rows = fp32_min_rows
        self.weight_f32: torch.Tensor | None = None
        self.bias_f32: torch.Tensor | None = None
        self.is_packed = False
        self.kernel = cpu_gemm.pack_for_kernel(weight) if use_kernel else None
        if fp32_min_rows is not None and weight.dtype != torch.float32:
            self.weight_f32 = weight.float()
            self.bias_f32 = bias.float() if bias is not None else None
            if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
                self.weight_f32 = torch.ops.mkldnn._reorder_linear_weight(self.weight_f32, None)
                self.is_packed = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant(x.float(), self.bias).to(x.dtype)
        rows = x.shape[0]
        if self.weight_f32 is not None and rows >= self.fp32_min_rows:  # type: ignore[operator]
            return self._linear_f32(x.float()).to(x.dtype)
        if self.kernel is not None:
            return self.kernel(x, self.bias, x.dtype)
        return F.linear(x, self.weight, self.bias)

    def _linear_f32(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_packed:
            return F.linear(x, self.weight_f32, self.bias_f32)
        rows = x.reshape(-1, x.shape[-1])  # (N, in)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.weight_f32, self.bias_f32, "none", [], "")
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @property
    def num_extra_bytes(self) -> int:
        """Memory held by the packed and float32 copies (0 without them)."""
        tensors = [t for t in (self.weight_f32, self.bias_f32) if t is not None]
        if self.quant is not None:  # the packed weight replaces the dense one
            return self.quant.num_bytes
        packed = self.kernel.num_bytes if self.kernel is not None else 0
        extra = packed + self.num_dequantized_bytes
        return extra + sum(t.numel() * t.element_size() for t in tensors)


@functools.cache
def _log_dequantized_once(dtype: torch.dtype) -> None:
    logger.warning(
        "quantized CPU matmul not used here (it needs AVX2 and a C++ compiler): "
        "GGUF weights are dequantized to %s at load", dtype,
    )  # fmt: skip


# Row counts from which float32 (oneDNN) beats the bf16 alternatives, on the 2-core AVX2 EPYC,
# "small" model projections, 2 threads (bench/linear_bench.py): torch's bf16 matmul ties with
# float32 at 8 rows; the packed bf16 kernel (with its session-5 prefetching and huge pages) is
# 5-20% faster than float32 at 48-96 rows, ties at 128-256 and falls behind from ~256 (medians).
FP32_MIN_ROWS_VS_TORCH_BF16 = 8
FP32_MIN_ROWS_VS_KERNEL = 128


def auto_fp32_min_rows(
    device: torch.device, dtype: torch.dtype, prefills_prompts: bool = True
) -> int | None:
    """Where many-row projections should switch to float32 copies; None: never (no copies).

    A worker that never prefills prompts (the decode role) makes none where the kernel runs:
    its batches are decode steps of at most max_num_seqs rows, and rare preemption recomputes,
    which the kernel runs at the same speed up to ~256 rows and ~10% slower beyond; the copies
    would double the weights' memory for nothing.
    """
    if dtype != torch.bfloat16 or has_fast_bf16_matmul(device):
        return None
    if cpu_ext.load() is None:
        return FP32_MIN_ROWS_VS_TORCH_BF16
    return FP32_MIN_ROWS_VS_KERNEL if prefills_prompts else None


def has_fast_bf16_matmul(device: torch.device) -> bool:
    """True where bf16 GEMM runs on native instructions (CUDA, or AVX512-BF16 / AMX CPUs)."""
    if device.type != "cpu":
        return True
    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2")
