"""A weight matrix kept in a GGUF block-quantized format (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K...).

The GGUF loader hands these to the model instead of dense tensors where a checkpoint stores a
projection quantized; :class:`~pdserve.kernels.linear.Linear` then runs them in the quantized CPU
matmul (each weight read at its packed size) or, where that kernel does not run, dequantizes them
once at load. Reference dequantization is the maintained ``gguf`` package's (ggml-org's gguf-py).

Rows are output features: row ``n`` holds the ``K`` input weights of output ``n`` as whole blocks,
so reordering rows (the loader's Q/K un-permutation) or looking rows up (a quantized embedding
table, dequantized row by row as tokens are embedded) never touches a block.
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
    # (N, bytes_per_row) uint8, C-contiguous; from a GGUF file a read-only view of its mapping
    data: np.ndarray

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
        return self._dense(self.data, dtype)

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (any shape) dense, as ``ids.shape + (K,)``: an embedding lookup that
        gathers the rows' blocks and dequantizes only them (the same values
        :meth:`dequantize` gives those rows: every block dequantizes on its own)."""
        index = ids.detach().cpu().reshape(-1).numpy()
        dense = self._dense(self.data[index], dtype)
        return dense.reshape(*ids.shape, self.shape[1])

    def _dense(self, rows: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """``rows`` (whole rows of this type's blocks) by gguf's reference dequantization."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        dense = dequantize(rows, GGMLQuantizationType[self.type_name])
        return torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)).to(dtype)

    @property
    def block_size(self) -> int:
        """The K elements one block of this type covers (1 for the float types)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        return GGML_QUANT_SIZES[GGMLQuantizationType[self.type_name]][0]

    def take_columns(self, start: int, stop: int) -> QuantizedTensor:
        """Input columns ``[start, stop)`` of every row (multiples of :attr:`block_size`:
        whole blocks move, a copy; nothing is requantized)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        size, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[self.type_name]]
        if start % size or stop % size:
            raise ValueError(f"{self.type_name} columns [{start}, {stop}) cut a {size}-block")
        data = np.ascontiguousarray(
            self.data[:, start // size * type_bytes : stop // size * type_bytes]
        )
        return QuantizedTensor(self.type_name, (self.shape[0], stop - start), data)

    def take_rows(self, index: np.ndarray | torch.Tensor) -> QuantizedTensor:
        """Rows reordered/selected by ``index`` (whole blocks move; nothing is requantized)."""
        rows = np.ascontiguousarray(self.data[np.asarray(index)])
        return QuantizedTensor(self.type_name, (rows.shape[0], self.shape[1]), rows)

    @staticmethod
    def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
        """Parts of one type stacked along N (a copy)."""
        names = {p.type_name for p in parts}
        if len(names) != 1 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("only parts of one type and width concatenate")
        data = np.ascontiguousarray(np.concatenate([p.data for p in parts]))
        return QuantizedTensor(parts[0].type_name, (data.shape[0], parts[0].shape[1]), data)


def stack_runs(parts: list[QuantizedTensor]) -> list[QuantizedTensor]:
    """``parts`` with each run of consecutive same-type parts stacked into one (a fused QKV or
    gate/up packs as one matrix per type). The stacked copies are for packing and are dropped
    with it: the loader's parts stay views of the mapped file."""
    runs: list[list[QuantizedTensor]] = []
    for p in parts:
        if runs and runs[-1][0].type_name == p.type_name:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [run[0] if len(run) == 1 else QuantizedTensor.cat_rows(run) for run in runs]
