"""Attention that reads the KV page pool directly (C++ kernel, torch reference).

The kernel (csrc/paged_attention.cpp) replaces, per layer, the page gather of
:class:`~pdserve.kernels.decode_context.DecodeContext`, the key mask and SDPA with one call that
walks each query row's pages in place. It serves decode steps (one row per sequence) and prompt
chunks (:func:`paged_extend_attention`: every row of a chunk, each against its own causal
prefix) with one code path, so a token's attention output has the same bits however its prompt
was chunked, cached or batched. Queries may be float32 over a bf16 pool (pdserve's CPU
serving: float32 activations, bf16 KV). The torch reference below computes the same thing from
copies; it is the fallback where the kernel cannot run (no compiler, no AVX2, other dtypes or
head sizes) and what the tests hold the kernel to.
"""

from __future__ import annotations

import types

import torch

from pdserve.kernels import cpu_ext
from pdserve.kernels.attention import (
    decode_attention,
    decode_key_mask,
    gather_pages,
    write_layer_kv,
)

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
MAX_KERNEL_HEAD_DIM = 256


def load_kernel(
    dtype: torch.dtype, head_dim: int, device: str | torch.device = "cpu"
) -> types.ModuleType | None:
    """The compiled module when the kernel handles a pool of ``dtype`` here, else None."""
    is_supported = (
        torch.device(device).type == "cpu"
        and dtype in KERNEL_DTYPES
        and head_dim % 16 == 0
        and head_dim <= MAX_KERNEL_HEAD_DIM
    )
    return cpu_ext.load() if is_supported else None


def paged_decode_attention(
    module: types.ModuleType | None,
    q: torch.Tensor,
    layer_pool: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    new_kv: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence against its pages: ``q`` ``(B, H, D)`` -> ``(B, H, D)``.

    ``layer_pool``: one layer's ``(num_pages, 2, page_size, Hkv, D)`` view (K at ``[:, 0]``, V at
    ``[:, 1]``); ``block_table`` ``(B, max_pages)`` and ``context_lens`` ``(B,)`` int64 (the
    new token included). ``new_kv`` ``(B, 2, Hkv, D)`` (``q``'s dtype): each sequence's new K
    and V, stored into its slot (position ``context_lens - 1``, in the pool's dtype) first; None
    when they are already in the pool. With a sliding window, key ``j`` is visible iff
    ``ctx - window <= j < ctx``. ``module``: from :func:`load_kernel`; None runs the torch
    reference.
    """
    if module is not None:
        return module.paged_attention(
            q, layer_pool, block_table, None, context_lens, scale, sliding_window or 0, new_kv
        )
    return reference_paged_decode_attention(
        q, layer_pool, block_table, context_lens, scale, sliding_window, new_kv
    )


def paged_extend_attention(
    module: types.ModuleType,
    q: torch.Tensor,
    layer_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_of_row: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    new_kv: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed prompt rows ``q`` ``(T, H, D)``, row ``t`` of sequence ``seq_of_row[t]`` at
    ``positions[t]``, each against its sequence's keys up to and including its own; every row's
    ``new_kv`` is stored first. Computes each row exactly as a decode step at that position."""
    return module.paged_attention(
        q, layer_pool, block_table, seq_of_row, positions + 1, scale, sliding_window or 0, new_kv
    )


def reference_paged_decode_attention(
    q: torch.Tensor,
    layer_pool: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    new_kv: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention in torch: store ``new_kv``, gather the pages, mask, SDPA (in ``q``'s
    dtype)."""
    if new_kv is not None:
        page_size = layer_pool.shape[2]
        slot = context_lens - 1
        rows = torch.arange(block_table.shape[0], device=block_table.device)
        page_idx = block_table[rows, slot // page_size]
        write_layer_kv(layer_pool, page_idx, slot % page_size, new_kv.to(layer_pool.dtype))
    keys = gather_pages(layer_pool[:, 0], block_table).to(q.dtype)
    values = gather_pages(layer_pool[:, 1], block_table).to(q.dtype)
    mask = decode_key_mask(context_lens, keys.shape[1], sliding_window)
    return decode_attention(q, keys, values, mask, scale)
