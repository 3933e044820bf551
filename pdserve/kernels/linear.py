"""Projections: one matmul path per weight, whatever the number of rows.

A token's projection must have the same bits alone, among a decode step's rows, in a prompt
chunk or inside a whole prompt (pdserve's batch invariance): no switching kernels by row count.
On CPUs the C++ kernel (:mod:`pdserve.kernels.cpu_gemm`) runs every row count: weights stay in
their stored format (bf16 or float32, packed once into panels), activations are float32 in and
float32 out, and each output element is one fixed-order float32 sum over the input features.
Elsewhere (CUDA, or no compiler) torch's ``F.linear`` runs in the activations' dtype.

GGUF-quantized weights (a :class:`~pdserve.model.quantized.QuantizedTensor`, or a list of them
stacked along N, types may differ) stay packed for :mod:`pdserve.kernels.quant_gemm` (same
rules: float32 in and out, one fixed-order sum per output element) where the C++ module runs;
elsewhere they are dequantized once, to the activations' dtype (bf16 where none is given).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_gemm, quant_gemm
from pdserve.model.quantized import QuantizedTensor, stack_runs

logger = logging.getLogger(__name__)


class Linear:
    """``y = x @ weight.T + bias`` in ``x``'s dtype.

    ``use_kernel``: pack the weight for the C++ CPU kernel where it runs (CPU bf16 or float32
    weights on AVX2 CPUs); otherwise ``F.linear`` on the weight converted once to ``act_dtype``.
    """

    def __init__(
        self,
        weight: torch.Tensor | QuantizedTensor | list[QuantizedTensor],
        bias: torch.Tensor | None = None,
        act_dtype: torch.dtype | None = None,
        use_kernel: bool = True,
    ) -> None:
        self.quant: quant_gemm.PackedQuantWeight | None = None
        if isinstance(weight, (QuantizedTensor, list)):
            parts = [weight] if isinstance(weight, QuantizedTensor) else weight
            # One packed matrix per run of a type (the stacked copy lives only while packing).
            self.quant = quant_gemm.pack_parts(stack_runs(parts)) if use_kernel else None
            if self.quant is not None:  # no dense weight is kept
                self.kernel, self.weight = None, None
                self.bias = bias.float() if bias is not None else None
                return
            _log_dequantized_once()
            # Straight to the activations' dtype: a float32 run keeps every dequantized bit.
            weight = torch.cat([p.dequantize(act_dtype or torch.bfloat16) for p in parts])
        act_dtype = act_dtype or weight.dtype
        self.kernel = cpu_gemm.pack_for_kernel(weight) if use_kernel else None
        self.bias = bias.to(act_dtype) if bias is not None else None
        # The kernel holds the packed copy; torch keeps the weight in the activations' dtype.
        self.weight = None if self.kernel is not None else weight.to(act_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant(x.float(), self.bias).to(x.dtype)
        if self.kernel is not None:
            return self.kernel(x, self.bias, x.dtype)
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    @property
    def num_bytes(self) -> int:
        """Memory this projection's weight occupies as it runs (the packed copy, if any)."""
        if self.quant is not None:
            return self.quant.num_bytes
        if self.kernel is not None:
            return self.kernel.num_bytes
        assert self.weight is not None
        return self.weight.numel() * self.weight.element_size()


@functools.cache
def _log_dequantized_once() -> None:
    logger.warning(
        "quantized CPU matmul not used here (it needs AVX2 and a C++ compiler): "
        "GGUF weights are dequantized at load"
    )
