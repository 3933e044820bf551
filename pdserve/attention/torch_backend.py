"""The torch reference backend: page gathers, masks and SDPA; runs on any device.

Decode copies each sequence's pages out of the pool a few layers at a time
(:class:`~pdserve.kernels.decode_context.DecodeContext`) and hides keys past each length (and
outside the window) with one additive mask per step; extend runs one fused SDPA call per
sequence (:func:`~pdserve.kernels.attention.prefill_attention`). It is what the other backends
are tested against, and the fallback where their kernels cannot run.
"""

from __future__ import annotations

import torch

from pdserve.attention.backend import AttentionBackend, AttentionConfig
from pdserve.kernels.attention import (
    additive_mask,
    decode_attention,
    decode_key_mask,
    prefill_attention,
    write_layer_kv,
)
from pdserve.kernels.decode_context import DecodeContext
from pdserve.kernels.kv_cache import KVPagePool
from pdserve.model.forward_batch import ForwardBatch


class TorchAttentionBackend(AttentionBackend):
    """Reference attention in plain torch (no CUDA graphs: its shapes follow the batch)."""

    name = "torch"

    def __init__(self, config: AttentionConfig, kv_pool: KVPagePool) -> None:
        super().__init__(config, kv_pool)
        device = kv_pool.kv.device
        dtype = config.act_dtype or kv_pool.config.dtype  # the queries' (SDPA masks match it)
        # Reused by every step's key mask (read only).
        max_keys = config.max_model_len + self.page_size
        self._key_positions = torch.arange(max_keys, device=device)
        self._zero_mask_row = torch.zeros(max_keys, dtype=dtype, device=device)
        self._context: DecodeContext | None = None
        self._key_mask: torch.Tensor | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._context = self._key_mask = None  # an extend-only forward uses neither
        super().init_forward_metadata(batch)

    def init_decode_metadata(self, batch: ForwardBatch) -> None:
        assert batch.context_lens is not None
        self._context = DecodeContext(self.kv_pool.storage, batch.block_table, batch.context_lens)
        self._key_mask = self._decode_mask(batch)

    def _decode_mask(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Additive ``(B, W * page_size)`` mask of the keys each query may not see, or None."""
        assert batch.context_lens is not None
        max_len = batch.block_table.shape[1] * self.page_size
        window = self.config.sliding_window
        is_windowed = window is not None and max_len > window
        if not is_windowed and batch.min_context_len == max_len:
            return None  # every key of every sequence is visible: no mask at all
        if is_windowed:
            mask = decode_key_mask(batch.context_lens, max_len, window)
            return additive_mask(mask, self._zero_mask_row.dtype)
        # Additive mask in one pass: 0 where key position < length, -inf from it on.
        is_hidden = self._key_positions[:max_len] >= batch.context_lens.unsqueeze(1)
        return self._zero_mask_row[:max_len].masked_fill(is_hidden, float("-inf"))

    def forward_extend(
        self, layer: int, q: torch.Tensor, new_kv: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        assert batch.prefill_seqs is not None
        pool = self.layer_pools[layer]
        stored = new_kv.to(pool.dtype)
        write_layer_kv(pool, batch.page_idx, batch.page_offset, stored)
        k_cache, v_cache = pool.unbind(1)
        kv = stored.to(q.dtype)  # attend to the keys as the pool holds them
        return prefill_attention(
            q, kv[:, 0], kv[:, 1], batch.prefill_seqs, k_cache, v_cache,
            self.config.scale, self.config.sliding_window,
        )  # fmt: skip

    def forward_decode(
        self, layer: int, q: torch.Tensor, new_kv: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        assert self._context is not None, "init_forward_metadata was not called"
        pool = self.layer_pools[layer]
        stored = new_kv.to(pool.dtype)
        write_layer_kv(pool, batch.page_idx, batch.page_offset, stored)
        # The context was copied before the first layer: the new tokens are added to the copy.
        keys, values = self._context.layer(layer, stored)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        return decode_attention(q, keys, values, self._key_mask, self.config.scale)
