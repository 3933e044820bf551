"""Prefill / extend attention in Triton over packed variable-length sequences and their pages.

Each sequence brings ``num_new`` query tokens after ``num_cached`` tokens whose K/V are already
in the pool; the new tokens' K/V must be stored before the call, so every key is read from the
pages in place (one code path for a fresh prompt and for an extend over a cached prefix). Query
``i`` (at position ``num_cached + i``) sees keys ``j <= num_cached + i``, and with a sliding
window only those with ``num_cached + i - j < window``. One program per (sequence, query head,
block of new tokens); key blocks past the block's last query are never visited.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton.common import LOG2E, dot_precision, head_block, upcast_dots

SMALL_BLOCK = 32  # query rows per program and keys per step: the interpreter, big heads
GPU_BLOCK = 64  # on a GPU for head_dim <= 128: fewer programs re-reading each key block


class LaunchConfig(NamedTuple):
    block_m: int  # query rows per program
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int | None  # None: Triton's default


def launch_config(
    head_dim: int, dtype: torch.dtype, capability: tuple[int, int] | None
) -> LaunchConfig:
    """Tiles and warps for a device of CUDA ``capability`` (None: the CPU's interpreter).

    Hopper with 16-bit operands and head_dim <= 128: 64 x 64 tiles over 8 warps, one stage.
    ptxas for sm_90a (Triton 3.9, bf16, head_dim 128, window on; tests/kernels/triton/
    sm90_compile.py prints it) spills 872 / 856 bytes per thread (stores / loads) with 4 warps
    (3 stages or 1), 352 / 352 with SGLang's 128 x 64 over 8 warps, 40 / 40 with this one.
    float32 models (exact dots) and older GPUs keep 64 x 64 over 4 warps. Chosen from compiles,
    not timed on a GPU.
    """
    if capability is None or head_dim > 128:
        return LaunchConfig(SMALL_BLOCK, SMALL_BLOCK, 4, None)
    if capability[0] >= 9 and dtype in (torch.bfloat16, torch.float16):
        return LaunchConfig(GPU_BLOCK, GPU_BLOCK, 8, 1)
    return LaunchConfig(GPU_BLOCK, GPU_BLOCK, 4, None)


@triton.jit
def _extend_kernel(
    q_ptr, pool_ptr, table_ptr, starts_ptr, num_new_ptr, num_cached_ptr, out_ptr,
    scale_log2, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    stride_page, stride_kv, stride_tok, stride_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    num_new = tl.load(num_new_ptr + seq)
    if m0 < num_new:
        q_start = tl.load(starts_ptr + seq)
        num_cached = tl.load(num_cached_ptr + seq)
        kv_head = head // GROUP
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < num_new
        q_pos = num_cached + rows
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        q_mask = row_mask[:, None] & dim_mask[None, :]
        q_offs = (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
        if UPCAST:
            q = q.to(tl.float32)
        hi = num_cached + tl.minimum(m0 + BLOCK_M, num_new)  # past this block's last query
        lo = hi * 0
        if HAS_WINDOW:
            lo = tl.maximum(num_cached + m0 - window + 1, 0)  # the first query's window
        # A finite start keeps exp2(m_old - m_new) defined for rows with no visible key yet.
        m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            toks = n0 + tl.arange(0, BLOCK_N)
            tok_mask = toks < hi
            page = tl.load(
                table_ptr + seq * stride_table + toks // PAGE_SIZE, mask=tok_mask, other=0
            )
            slot = page * stride_page + (toks % PAGE_SIZE) * stride_tok + kv_head * stride_head
            kv_mask = tok_mask[:, None] & dim_mask[None, :]
            k = tl.load(pool_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (M, N)
            visible = tok_mask[None, :] & (toks[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (q_pos[:, None] - toks[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            row_sum = row_sum * alpha + tl.sum(p, 1)
            v = tl.load(
                pool_ptr + stride_kv + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0
            )
            p = p.to(v.dtype)  # the PV product in the cache dtype, as flash attention does
            if UPCAST:
                p, v = p.to(tl.float32), v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m = m_new
        out = acc / tl.where(row_mask, row_sum, 1.0)[:, None]  # every real row sees its own key
        o_offs = (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def extend_attention(
    q: torch.Tensor,
    layer_pool: torch.Tensor,
    block_table: torch.Tensor,
    q_starts: torch.Tensor,
    num_new: torch.Tensor,
    num_cached: torch.Tensor,
    max_new: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Packed queries ``q`` ``(T, H, D)`` -> ``(T, H, D)``, causal over each sequence's pages.

    ``layer_pool`` ``(num_pages, 2, page_size, Hkv, D)`` holds every key, the new ones included;
    ``block_table`` ``(B, W)`` int64 covers each sequence's ``num_cached + num_new`` tokens;
    ``q_starts``, ``num_new``, ``num_cached`` ``(B,)`` int64 device tensors; ``max_new`` (a host
    int) is the largest ``num_new``, which sizes the grid.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = layer_pool.shape[2], layer_pool.shape[3]
    assert q.stride(2) == 1 and layer_pool.stride(4) == 1, "head_dim must be contiguous"
    out = torch.empty_like(q)
    is_cuda = q.device.type == "cuda"
    cfg = launch_config(head_dim, q.dtype, torch.cuda.get_device_capability(q.device) if is_cuda
                        else None)  # fmt: skip
    tuning = {"num_warps": cfg.num_warps}
    if cfg.num_stages is not None:
        tuning["num_stages"] = cfg.num_stages
    grid = (block_table.shape[0], num_heads, triton.cdiv(max_new, cfg.block_m))
    _extend_kernel[grid](
        q, layer_pool, block_table, q_starts, num_new, num_cached, out,
        scale * LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        layer_pool.stride(0), layer_pool.stride(1), layer_pool.stride(2), layer_pool.stride(3),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=head_block(head_dim),
        HAS_WINDOW=sliding_window is not None, PRECISION=dot_precision(q.dtype),
        UPCAST=upcast_dots(q, layer_pool), **tuning,
    )  # fmt: skip
    return out
