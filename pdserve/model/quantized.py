"""A weight matrix kept in a GGUF block-quantized format (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K...).

The GGUF loader hands these to the model instead of dense tensors where a checkpoint stores a
projection quantized; :class:`~pdserve.kernels.linear.Linear` then runs them in the quantized CPU
matmul (each weight read at its packed size) or, where that kernel does not run, dequantizes them
once at load. Reference dequantization is the maintained ``gguf`` package's (ggml-org's gguf-py).

Rows are output features: row ``n`` holds the ``K`` input weights of output ``n`` as whole blocks,
so reordering or concatenating rows (the loader's Q/K un-permutation, fused QKV and gate/up
projections) never touches a block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class QuantizedTensor:
    """``(N, K)`` weights as GGUF blocks: ``data`` is ``(N, bytes_per_row)`` uint8."""

    type_name: str  # the GGML type's name, e.g. "Q4_K" (gguf.GGMLQuantizationType[type_name])
    shape: tuple[int, int]  # (N, K) in elements
    data: np.ndarray  # (N, bytes_per_row) uint8, C-contiguous

    def __post_init__(self) -> None:
        if (
            self.data.dtype != np.uint8
            or self.data.ndim != 2
            or self.data.shape[0] != self.shape[0]
        ):
            raise ValueError(f"{self.type_name} data must be (N, bytes_per_row) uint8")

    @property
    def num_bytes(self) -> int:
        return int(self.data.nbytes)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``(N, K)`` tensor, by gguf's reference dequantization."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        dense = dequantize(self.data, GGMLQuantizationType[self.type_name])
        return torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)).to(dtype)

    def take_rows(self, index: np.ndarray | torch.Tensor) -> QuantizedTensor:
        """Rows reordered/selected by ``index`` (whole blocks move; nothing is requantized)."""
        rows = np.ascontiguousarray(self.data[np.asarray(index)])
        return QuantizedTensor(self.type_name, (rows.shape[0], self.shape[1]), rows)

    @staticmethod
    def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
        """Parts of one type stacked along N (a fused projection)."""
        names = {p.type_name for p in parts}
        if len(names) != 1 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("only parts of one type and width concatenate")
        data = np.ascontiguousarray(np.concatenate([p.data for p in parts]))
        return QuantizedTensor(parts[0].type_name, (data.shape[0], parts[0].shape[1]), data)
