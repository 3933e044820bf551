"""The AVX2 dense-weight (bf16 or float32) matmul for every row count (csrc/dense_gemm.cpp).

The kernel lives in the C++ CPU module of :mod:`pdserve.kernels.cpu_ext` (built once per
machine). ``python -m pdserve.kernels.cpu_gemm`` builds that module ahead of time (``make
install`` runs it), so servers only load it. Where it cannot run, callers fall back to torch.
"""

from __future__ import annotations

import logging
import types

import torch

from pdserve.kernels import cpu_ext


class PackedDenseWeight:
    """A ``(N, K)`` bf16 or float32 weight packed for the kernel; call it on ``(M, K)`` rows."""

    def __init__(self, module: types.ModuleType, weight: torch.Tensor) -> None:
        self._module = module
        self.out_features = weight.shape[0]
        self.packed = module.pack(weight.contiguous())

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
    ) -> torch.Tensor:
        if x.dim() == 2:  # the model's case: skip two reshapes (each a dispatched op)
            return self._module.linear(x, self.packed, self.out_features, bias, out_dtype)
        rows = x.reshape(-1, x.shape[-1])
        y = self._module.linear(rows, self.packed, self.out_features, bias, out_dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    @property
    def num_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


def pack_for_kernel(weight: torch.Tensor) -> PackedDenseWeight | None:
    """Packs a CPU bf16 or float32 weight when the kernel runs here, else None (use torch)."""
    is_supported = weight.device.type == "cpu" and weight.dim() == 2
    if not is_supported or weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    module = cpu_ext.load()
    return PackedDenseWeight(module, weight) if module is not None else None


if __name__ == "__main__":  # `python -m pdserve.kernels.cpu_gemm`: build ahead of time
    logging.basicConfig(level=logging.INFO)
    where = cpu_ext.library_path(cpu_ext.default_cache_dir())
    print(f"C++ CPU kernels: {'ready at ' + str(where) if cpu_ext.load() else 'unavailable'}")
