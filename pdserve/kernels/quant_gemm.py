"""GGUF block-quantized weights kept quantized on CPUs (csrc/quant_pack.cpp, csrc/quant_gemm.cpp).

A :class:`~pdserve.model.quantized.QuantizedTensor` (or several stacked along N, of possibly
different types: Q4_K_M files mix Q4_K and Q6_K within one fused projection) is packed once at
load into panels of 16 output columns; a call multiplies float32 rows by it and returns float32,
each weight unpacked in registers from its packed bytes. Every output element is one fixed fma
chain over k, whatever the number of rows, their grouping or the thread count (batch-invariant).

Supported types: :data:`SUPPORTED_TYPES`.
"""

from __future__ import annotations

import types
import warnings

import numpy as np
import torch

from pdserve.kernels import cpu_ext
from pdserve.model.quantized import QuantizedTensor

# GGML type ids (gguf.GGMLQuantizationType), as the C++ side names them.
GGML_TYPE_IDS = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
    "BF16": 30,
}
SUPPORTED_TYPES = frozenset(GGML_TYPE_IDS)


class PackedQuantWeight:
    """Parts ``(N_i, K)`` of GGUF-quantized weights packed for the kernel, stacked along N.

    Call it on float32 ``(M, K)`` rows (or ``(..., K)``) for float32 ``(M, sum N_i)``.
    """

    def __init__(self, module: types.ModuleType, parts: list[QuantizedTensor]) -> None:
        if not parts:
            raise ValueError("no parts to pack")
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError("parts must share K (input features)")
        unsupported = {p.type_name for p in parts} - SUPPORTED_TYPES
        if unsupported:
            raise ValueError(f"quantized matmul does not support {sorted(unsupported)}")
        self._module = module
        self.in_features = parts[0].shape[1]
        self.type_names = [p.type_name for p in parts]
        self.part_sizes = [p.shape[0] for p in parts]
        self.out_features = sum(self.part_sizes)
        self.type_ids = [GGML_TYPE_IDS[name] for name in self.type_names]
        self.packed = [
            module.quant_pack(_read_only_tensor(p.data), type_id, self.in_features)
            for p, type_id in zip(parts, self.type_ids, strict=True)
        ]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` in float32; ``x`` is float32 with ``K`` features last."""
        if x.dtype != torch.float32:
            raise TypeError(f"quantized matmul takes float32 rows, got {x.dtype}")
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        y = self._module.quant_linear(rows, self.packed, self.type_ids, self.part_sizes, bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    @property
    def num_bytes(self) -> int:
        """Bytes of the packed weights (what a step streams; for memory accounting)."""
        return sum(t.numel() for t in self.packed)


def _read_only_tensor(data: np.ndarray) -> torch.Tensor:
    """``data`` (often a read-only view of a mapped GGUF file) as a tensor, uncopied: the
    packing only reads it, so torch's warning about non-writable arrays does not apply."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data)


def pack_parts(parts: list[QuantizedTensor]) -> PackedQuantWeight | None:
    """Packs parts stacked along N when the kernel runs here (AVX2 + a C++ compiler), else
    None (the caller dequantizes instead)."""
    module = cpu_ext.load()
    return PackedQuantWeight(module, parts) if module is not None else None


def pack(weight: QuantizedTensor) -> PackedQuantWeight | None:
    """One quantized weight; see :func:`pack_parts`."""
    return pack_parts([weight])
