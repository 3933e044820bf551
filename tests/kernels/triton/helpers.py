"""Page pools with scattered pages for the Triton kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NUM_LAYERS, LAYER = 2, 1


@dataclass
class PagedSetup:
    layer_pool: torch.Tensor  # (num_pages, 2, page_size, Hkv, D): one layer's strided view
    block_table: torch.Tensor  # (B, W) int64, padded with the scratch page
    scratch_page: int


def scattered_pool(
    lens: list[int], page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: str, gen: torch.Generator,
) -> PagedSetup:  # fmt: skip
    """A pool whose sequences own shuffled, non-adjacent pages; every page no sequence owns (the
    scratch page included) holds NaN, so a kernel that reads one poisons its output."""
    counts = [-(-n // page_size) for n in lens]
    num_pages = 2 * sum(counts) + 1  # half of them unowned, the last is the scratch page
    scratch = num_pages - 1
    shape = (num_pages, NUM_LAYERS, 2, page_size, num_kv_heads, head_dim)
    pool = torch.full(shape, float("nan"))
    order = torch.randperm(num_pages - 1, generator=gen)
    rows, used = [], 0
    for count in counts:
        pages = order[used : used + count]
        pool[pages] = torch.randn((count, *shape[1:]), generator=gen)
        rows.append(pages.tolist() + [scratch] * (max(counts) - count))
        used += count
    return PagedSetup(
        pool.to(dtype).to(device)[:, LAYER], torch.tensor(rows, device=device), scratch
    )


def readable(layer_pool: torch.Tensor) -> torch.Tensor:
    """The pool with its NaN pages zeroed, for the torch reference (which gathers whole pages
    and masks keys after the product, so it reads padding the kernels must not)."""
    return layer_pool.float().nan_to_num(0.0)
