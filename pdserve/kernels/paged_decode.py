"""Decode attention that reads the KV page pool directly (C++ kernel, torch reference).

The kernel (csrc/paged_attention.cpp) replaces, per layer, the page gather of
:class:`~pdserve.kernels.decode_context.DecodeContext`, the key mask and SDPA with one call that
walks each sequence's pages in place. The torch reference below computes the same thing from
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
    """The compiled module when the kernel handles this model here, else None (use torch)."""
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
    new token included). ``new_kv`` ``(B, 2, Hkv, D)``: each sequence's new K and V, stored
    into its slot (position ``context_lens - 1``) first; None when they are already in the
    pool. With a sliding window, key ``j`` is visible iff ``ctx - window <= j < ctx``.
    ``module``: from :func:`load_kernel`; None runs the torch reference.
    """
    if module is not None:
        return module.paged_decode_attention(
            q, layer_pool, block_table, context_lens, scale, sliding_window or 0, new_kv
        )
    return reference_paged_decode_attention(
        q, layer_pool, block_table, context_lens, scale, sliding_window, new_kv
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
    """The same attention in torch: store ``new_kv``, gather the pages, mask, SDPA."""
    if new_kv is not None:
        page_size = layer_pool.shape[2]
        slot = context_lens - 1
        rows = torch.arange(block_table.shape[0], device=block_table.device)
        page_idx = block_table[rows, slot // page_size]
        write_layer_kv(layer_pool, page_idx, slot % page_size, new_kv)
    keys = gather_pages(layer_pool[:, 0], block_table)
    values = gather_pages(layer_pool[:, 1], block_table)
    mask = decode_key_mask(context_lens, keys.shape[1], sliding_window)
    return decode_attention(q, keys, values, mask, scale)
