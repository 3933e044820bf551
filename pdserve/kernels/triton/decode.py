"""Paged decode attention in Triton: one query token per sequence, split-K (flash-decoding).

Reads the page pool in place, one layer's ``(num_pages, 2, page_size, Hkv, D)`` view. Each
program takes one (sequence, KV head, split): the ``group`` query heads that share the KV head
are the rows of one tile, so each K/V block is loaded once for all of them (GQA). A sequence's
visible keys are cut into ``num_splits`` chunks, so one long context keeps many SMs busy; a
second kernel merges the chunks by their log-sum-exp.

Everything the step varies (context lengths, the block table and its width) is read from device
tensors, and the grid depends only on the batch size: a launch can be captured in a CUDA graph
and replayed with other lengths and tables.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton.common import LOG2E, dot_precision, head_block, upcast_dots

BLOCK_N = 32  # keys per inner step
MIN_BLOCK_H = 16  # tl.dot needs 16 rows: small GQA groups are padded with masked rows
MAX_SPLITS = 16


def num_splits_for(num_kv_heads: int, num_sms: int) -> int:
    """Splits per context, fixed for a model on a device: enough (KV head, split) programs of
    one sequence for about two waves over ``num_sms`` multiprocessors, a power of two in
    [1, MAX_SPLITS]. Never from the batch size: a context's split boundaries (and so the order
    its keys are summed in) must not depend on its batch mates."""
    wanted = -(-2 * num_sms // num_kv_heads)
    return min(MAX_SPLITS, triton.next_power_of_2(max(1, wanted)))


def workspace_floats(num_seqs: int, num_heads: int, num_splits: int, head_dim: int) -> int:
    """float32 elements of the per-split outputs and log-sum-exps of one launch."""
    return num_seqs * num_heads * num_splits * (head_block(head_dim) + 1)


@triton.jit
def _decode_split_kernel(
    q_ptr, pool_ptr, table_ptr, table_width_ptr, lens_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, window,
    stride_qb, stride_qh,
    stride_page, stride_kv, stride_tok, stride_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    ctx = tl.load(lens_ptr + seq)
    table_width = tl.load(table_width_ptr)
    start = ctx * 0
    if HAS_WINDOW:
        start = tl.maximum(ctx - window, 0)
    # This split's chunk of the visible keys [start, ctx), a whole number of key blocks.
    chunk = tl.cdiv(tl.cdiv(ctx - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, ctx)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # (BLOCK_H, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)
    # A finite start keeps exp2(m_old - m_new) defined before the first visible key.
    m = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        tok_mask = toks < hi
        page = tl.load(table_ptr + seq * table_width + toks // PAGE_SIZE, mask=tok_mask, other=0)
        slot = page * stride_page + (toks % PAGE_SIZE) * stride_tok + kv_head * stride_head
        kv_mask = tok_mask[:, None] & dim_mask[None, :]
        k = tl.load(pool_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (BLOCK_H, BLOCK_N)
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v = tl.load(pool_ptr + stride_kv + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        p = p.to(v.dtype)  # the PV product in the cache dtype, as flash attention does
        if UPCAST:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new
    is_empty = row_sum == 0.0  # a split past the end of a short context
    out = acc / tl.where(is_empty, 1.0, row_sum)[:, None]
    lse = tl.where(is_empty, float("-inf"), m + tl.log2(tl.where(is_empty, 1.0, row_sum)))
    part = (seq * num_heads + heads) * NUM_SPLITS + split  # (B, H, NUM_SPLITS) row index
    tl.store(part_out_ptr + part[:, None] * BLOCK_D + dims[None, :], out, mask=row_mask[:, None])
    tl.store(part_lse_ptr + part, lse, mask=row_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + splits)  # the first split is never empty
    weight = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(part_out_ptr + (row * NUM_SPLITS + splits)[:, None] * BLOCK_D + dims[None, :])
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def paged_decode_attention(
    q: torch.Tensor,
    layer_pool: torch.Tensor,
    block_table: torch.Tensor,
    block_table_width: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int = 8,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q`` ``(B, H, D)`` against each sequence's pages -> ``(B, H, D)``.

    ``layer_pool`` ``(num_pages, 2, page_size, Hkv, D)`` (K at ``[:, 0]``, V at ``[:, 1]``), the
    step's new K/V already stored; ``block_table``: int64 page ids, row ``b`` starting at
    element ``b * block_table_width`` (a ``(1,)`` int64 device tensor, so a captured graph can
    replay tables of another width); ``context_lens`` ``(B,)`` int64, the new token included.
    Key ``j`` is visible iff ``j < ctx`` (and ``j >= ctx - window``). ``num_splits``: a power
    of two, the chunks each context is cut into. ``workspace``: a float32 buffer of at least
    :func:`workspace_floats` elements for the partial results (a static one under CUDA graphs);
    None allocates one. No host synchronisation.
    """
    num_seqs, num_heads, head_dim = q.shape
    page_size, num_kv_heads = layer_pool.shape[2], layer_pool.shape[3]
    group = num_heads // num_kv_heads
    block_d = head_block(head_dim)
    assert q.stride(2) == 1 and layer_pool.stride(4) == 1, "head_dim must be contiguous"
    num_parts = num_seqs * num_heads * num_splits
    if workspace is None:
        workspace = torch.empty(
            workspace_floats(num_seqs, num_heads, num_splits, head_dim),
            dtype=torch.float32, device=q.device,
        )  # fmt: skip
    part_out = workspace[: num_parts * block_d]  # (B, H, splits, BLOCK_D)
    part_lse = workspace[num_parts * block_d : num_parts * (block_d + 1)]  # (B, H, splits)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, layer_pool, block_table, block_table_width, context_lens, part_out, part_lse,
        scale * LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1),
        layer_pool.stride(0), layer_pool.stride(1), layer_pool.stride(2), layer_pool.stride(3),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        BLOCK_H=max(MIN_BLOCK_H, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N,
        BLOCK_D=block_d, HAS_WINDOW=sliding_window is not None,
        PRECISION=dot_precision(q.dtype), UPCAST=upcast_dots(q, layer_pool),
    )  # fmt: skip
    out = torch.empty_like(q)
    _decode_merge_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_D=block_d,
    )  # fmt: skip
    return out
