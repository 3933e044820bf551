"""The CPU backend: decode and extend (prompts, chunks) through the C++ paged kernels.

The kernels (:mod:`pdserve.kernels.paged_attention`) walk each sequence's pages in place and
store the step's new K/V themselves: no page gather, no key mask, nothing to prepare per
forward. Each prompt row is computed as a decode step at its position would compute it.
"""

from __future__ import annotations

import torch

from pdserve.attention.backend import AttentionConfig
from pdserve.attention.torch_backend import TorchAttentionBackend
from pdserve.kernels.kv_cache import KVPagePool
from pdserve.kernels.paged_attention import (
    load_kernel,
    paged_decode_attention,
    paged_extend_attention,
)
from pdserve.model.forward_batch import ForwardBatch


class CppAttentionBackend(TorchAttentionBackend):
    """The C++ kernel for every row (CPU, float32/bf16 pool, head_dim a multiple of 16)."""

    name = "cpp"

    def __init__(self, config: AttentionConfig, kv_pool: KVPagePool) -> None:
        super().__init__(config, kv_pool)
        kv = kv_pool.config
        self._kernel = load_kernel(kv.dtype, kv.head_dim, kv_pool.kv.device)
        if self._kernel is None:
            raise ValueError(f"the C++ attention kernel does not run here ({kv.dtype})")

    def kernel_rows(self, batch: ForwardBatch) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """``(seq_of_row, lens)`` for one kernel call over all of ``batch``'s rows, as
        forward_decode / forward_extend pass them (None for a mixed batch: it runs in two)."""
        if batch.parts is not None:
            return None
        if batch.is_decode:
            assert batch.context_lens is not None
            return None, batch.context_lens
        assert batch.seq_of_row is not None
        return batch.seq_of_row, batch.positions + 1

    def init_decode_metadata(self, batch: ForwardBatch) -> None:
        pass  # the kernel reads the lengths and the block table itself

    def forward_extend(
        self, layer: int, q: torch.Tensor, new_kv: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        assert batch.seq_of_row is not None
        return paged_extend_attention(
            self._kernel, q, self.layer_pools[layer], batch.block_table, batch.seq_of_row,
            batch.positions, self.config.scale, self.config.sliding_window, new_kv,
        )  # fmt: skip

    def forward_decode(
        self, layer: int, q: torch.Tensor, new_kv: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        assert batch.context_lens is not None
        return paged_decode_attention(
            self._kernel, q, self.layer_pools[layer], batch.block_table, batch.context_lens,
            self.config.scale, self.config.sliding_window, new_kv,
        )  # fmt: skip
