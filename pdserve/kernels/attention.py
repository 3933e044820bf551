"""Paged attention on CPU in plain torch: KV writes, varlen causal prefill, batched decode.

The caches are one layer's strided views of the page pool, ``(num_pages, page_size, Hkv, D)``.
A token at position ``p`` of a sequence lives in page ``page_ids[p // page_size]`` at offset
``p % page_size``. Grouped-query attention is computed without repeating K/V: the query heads
that share one KV head are laid out as extra query rows of that head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeqMeta:
    """One sequence's slice of a packed prefill batch."""

    q_start: int  # first row of this sequence in the packed query tensor
    num_new: int  # tokens computed in this forward
    num_cached: int  # tokens before them whose K/V are already in the pages
    page_ids: torch.Tensor  # (num_pages,) int64, covering num_cached + num_new tokens


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_idx: torch.Tensor,
    page_offset: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Scatter per-token ``k``/``v`` ``(T, Hkv, D)`` into their (page, offset) slots."""
    k_cache[page_idx, page_offset] = k
    v_cache[page_idx, page_offset] = v


def write_layer_kv(
    layer_pool: torch.Tensor, page_idx: torch.Tensor, page_offset: torch.Tensor, kv: torch.Tensor
) -> None:
    """Scatter per-token ``kv`` ``(T, 2, Hkv, D)`` (K and V side by side) into one layer's pool
    view ``(num_pages, 2, page_size, Hkv, D)``: one indexed write instead of two."""
    layer_pool[page_idx, :, page_offset] = kv


def gather_kv(cache: torch.Tensor, page_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """One sequence's first ``num_tokens`` tokens from its pages, ``(num_tokens, Hkv, D)``."""
    pages = cache.index_select(0, page_ids)
    return pages.flatten(0, 1)[:num_tokens]


def causal_mask(
    num_cached: int, num_new: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """Boolean ``(num_new, num_cached + num_new)``: query i (at num_cached+i) sees keys j <= it."""
    q_pos = torch.arange(num_cached, num_cached + num_new, device=device).unsqueeze(1)
    k_pos = torch.arange(num_cached + num_new, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    return mask


def _sdpa_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    # q (Tq, H, D), k/v (Tk, Hkv, D) -> (Tq, H, D); GQA via enable_gqa (no K/V copies).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqs: list[PrefillSeqMeta],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention for packed sequences ``q/k/v`` ``(T, heads, D)`` -> ``(T, H, D)``.

    New tokens' K/V must already be written to the caches. A sequence with a cached prefix
    reads its keys from the pages; one without uses ``k``/``v`` directly (no gather). The loop
    is over sequences, each a single fused attention call.

    A chunk over a cached prefix runs the same flash kernel as the whole prompt would, under a
    mask: each query row's result is then bit-identical to its row of a whole-prompt prefill,
    which is what keeps greedy output identical with the prefix cache and chunking on or off
    (splitting prefix and chunk into two calls merged by log-sum-exp was ~25% faster per chunk
    on a CPU but changed the last bits, and greedy continuations with them).
    """
    out = torch.empty_like(q)
    for s in seqs:
        rows = slice(s.q_start, s.q_start + s.num_new)
        if s.num_cached == 0:
            ks, vs = k[rows], v[rows]
        else:
            total = s.num_cached + s.num_new
            ks = gather_kv(k_cache, s.page_ids, total).to(q.dtype)
            vs = gather_kv(v_cache, s.page_ids, total).to(q.dtype)
        mask = None
        if s.num_cached or sliding_window is not None:
            mask = causal_mask(s.num_cached, s.num_new, sliding_window, q.device)
        out[rows] = _sdpa_gqa(q[rows], ks, vs, mask, scale)
    return out


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence, ``q`` ``(B, H, D)`` -> ``(B, H, D)``.

    ``keys``/``values`` ``(B, L, Hkv, D)`` hold each sequence's context (its pages, copied by
    :class:`~pdserve.kernels.decode_context.DecodeContext` or :func:`gather_pages`);
    ``key_mask`` ``(B, L)`` says which keys the query may see: bool (True: visible), or
    additive (0 / -inf) in the query dtype, which saves SDPA a conversion per layer (see
    :func:`additive_mask`); None when every key is visible.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    # The `group` query heads of one KV head act as `group` query rows against it.
    queries = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = key_mask[:, None, None, :] if key_mask is not None else None
    out = F.scaled_dot_product_attention(
        queries, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.reshape(num_seqs, num_heads, head_dim)


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """``(B, max_pages * page_size, Hkv, D)`` copy of the pages in ``block_table``."""
    pages = cache.index_select(0, block_table.flatten())
    return pages.view(block_table.shape[0], -1, *cache.shape[2:])


def decode_key_mask(
    context_lens: torch.Tensor, max_len: int, sliding_window: int | None = None
) -> torch.Tensor:
    """``(B, max_len)`` bool: key j is visible to a query at ``context_lens - 1``."""
    k_pos = torch.arange(max_len, device=context_lens.device).unsqueeze(0)
    mask = k_pos < context_lens.unsqueeze(1)
    if sliding_window is not None:
        mask &= k_pos >= (context_lens - sliding_window).unsqueeze(1)
    return mask


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as 0 (visible) / -inf (hidden) in ``dtype``."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )
