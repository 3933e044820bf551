"""The K/V a decode step reads, copied out of the page pool a few layers at a time.

Only the torch decode path uses it: where the C++ kernel runs, attention reads the pool in
place (:mod:`pdserve.kernels.paged_attention`).

Gathering each layer's pages separately costs two small copies per layer, each big enough to
become a parallel region; on a busy 2-core machine every parallel region can wait a scheduler
time slice for its second thread. One gather for many layers replaces them, bounded in bytes.

The pool is ``(pages, Hkv, L, 2, page_size, D)`` (kernels/kv_cache.py): a gather picks the
step's pages of a range of layers, then lays them out per layer, K/V, sequence and position.
"""

from __future__ import annotations

import torch

DEFAULT_MAX_GATHER_BYTES = 64 * 1024 * 1024


class DecodeContext:
    """Per-step copies ``(B, max_pages * page_size, Hkv, D)`` of each layer's keys and values.

    The step's new tokens are not in the pool when the copy is made; :meth:`layer` writes them
    into the copy (the caller writes them into the pool). The gather runs before the first
    layer (one copy for many layers, see above), so the new tokens cannot be in the pool yet.
    """

    def __init__(
        self,
        pool: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        max_gather_bytes: int = DEFAULT_MAX_GATHER_BYTES,
    ) -> None:
        _, num_kv_heads, self.num_layers, _, page_size, head_dim = pool.shape
        self._pool = pool
        self._pages = block_table.flatten()
        self._shape = (block_table.shape[0], block_table.shape[1] * page_size)
        self._head_shape = (num_kv_heads, head_dim)
        # Slot of each sequence's newest token in its flattened context copy.
        self._new_slots = torch.arange(self._shape[0], device=pool.device) * self._shape[1]
        self._new_slots += context_lens - 1
        page_elems = page_size * num_kv_heads * head_dim
        bytes_per_layer = 2 * self._pages.numel() * page_elems * pool.element_size()
        num_layers = max(1, max_gather_bytes // bytes_per_layer)
        self.num_layers_per_gather = min(self.num_layers, num_layers)
        self._start = self._stop = 0  # layers [start, stop) are in the current chunk
        self._chunk = pool.new_empty(0)

    def _gather(self, start: int) -> None:
        stop = min(start + self.num_layers_per_gather, self.num_layers)
        # (B * W, Hkv, layers, 2, page, D) -> (layers, K/V, B, context, Hkv, D), contiguous:
        # each layer's K and V are plain views.
        picked = self._pool[:, :, start:stop].index_select(0, self._pages)
        self._chunk = picked.permute(2, 3, 0, 4, 1, 5).reshape(
            stop - start, 2, *self._shape, *self._head_shape
        )
        self._start, self._stop = start, stop

    def layer(self, index: int, new_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer ``index``, including this step's ``new_kv`` ``(B, 2, Hkv, D)``
        (each sequence's new K and V)."""
        if not self._start <= index < self._stop:
            self._gather(index)
        kv = self._chunk[index - self._start]  # (2, B, context, Hkv, D)
        # One scatter for K and V: (2, B * context, Hkv, D)[:, slots] = (2, B, Hkv, D).
        kv.view(2, -1, *self._head_shape)[:, self._new_slots] = new_kv.transpose(0, 1)
        return kv[0], kv[1]
