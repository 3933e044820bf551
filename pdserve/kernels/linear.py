"""Projections: one matmul path per weight, whatever the number of rows.

A token's projection must have the same bits alone, among a decode step's rows, in a prompt
chunk or inside a whole prompt (pdserve's batch invariance): no switching kernels by row count.
On CPUs the C++ kernel (:mod:`pdserve.kernels.cpu_gemm`) runs every row count: weights stay in
their stored format (bf16 or float32, packed once into panels), activations are float32 in and
float32 out, and each output element is one fixed-order float32 sum over the input features.
Elsewhere (CUDA, or no compiler) torch's ``F.linear`` runs in the activations' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_gemm


class Linear:
    """``y = x @ weight.T + bias`` in ``x``'s dtype.

    ``use_kernel``: pack the weight for the C++ CPU kernel where it runs (CPU bf16 or float32
    weights on AVX2 CPUs); otherwise ``F.linear`` on the weight converted once to ``act_dtype``.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        act_dtype: torch.dtype | None = None,
        use_kernel: bool = True,
    ) -> None:
        act_dtype = act_dtype or weight.dtype
        self.kernel = cpu_gemm.pack_for_kernel(weight) if use_kernel else None
        self.bias = bias.to(act_dtype) if bias is not None else None
        # The kernel holds the packed copy; torch keeps the weight in the activations' dtype.
        self.weight = None if self.kernel is not None else weight.to(act_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.bias, x.dtype)
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    @property
    def num_bytes(self) -> int:
        """Memory this projection's weight occupies as it runs (the packed copy, if any)."""
        if self.kernel is not None:
            return self.kernel.num_bytes
        assert self.weight is not None
        return self.weight.numel() * self.weight.element_size()
