"""The paged KV cache: one page-major tensor plus a page allocator.

Layout (page-major): ``(num_pages, num_layers, 2, page_size, num_kv_heads, head_dim)``.
All layers' K and V of one page are contiguous, so a room's KV transfer is one NIXL descriptor
per page, and runs of adjacent pages coalesce into one descriptor. The same tensor is what the
model runner reads and writes and what the transport registers with NIXL.

One extra **scratch page** follows the allocator's ``num_pages`` in the same storage: padded
rows of a batch (CUDA-graph buckets, block-table padding) read and write it, so padding never
touches a live page. No sequence owns it; the allocator, the transport's page ids and the
registered tensor (:attr:`KVPagePool.kv`) do not include it, while the per-layer views the
attention kernels read (:meth:`KVPagePool.layer_view`) do.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int = 16  # tokens per page
    dtype: torch.dtype = torch.bfloat16

    @property
    def page_bytes(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * elem

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)


def hugepage_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeroed CPU tensor on anonymous memory advised MADV_HUGEPAGE.

    Measured (bench/transfer.py): NIXL/UCX writes between huge-page pools run about 2x faster for
    large rooms, since the kernel's cross-process copy walks far fewer page-table entries.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # keeps a reference to buf
    flat.zero_()  # fault it in now, as 2 MiB pages where the kernel can
    return flat.view(dtype).view(shape)


class KVPagePool:
    """Owns the KV tensor. Pages are handed out by a :class:`PageAllocator`."""

    def __init__(
        self, config: KVCacheConfig, device: str | torch.device = "cpu", hugepages: bool = True
    ) -> None:
        self.config = config
        c = config
        shape = (c.num_pages + 1, c.num_layers, 2, c.page_size, c.num_kv_heads, c.head_dim)
        if torch.device(device).type == "cpu" and hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
            self.storage = hugepage_zeros(shape, c.dtype)  # (P + 1, L, 2, page, Hkv, D)
        else:
            self.storage = torch.zeros(shape, dtype=c.dtype, device=device)
        # The allocator's pages (a contiguous prefix of the storage): what NIXL registers.
        self.kv = self.storage[: c.num_pages]  # (P, L, 2, page, Hkv, D)

    @property
    def scratch_page(self) -> int:
        """The page id padded batch rows point at (never allocated, never transferred)."""
        return self.config.num_pages

    def layer_view(self, layer: int) -> torch.Tensor:
        """One layer's K and V pages, the scratch page included,
        ``(num_pages + 1, 2, page_size, Hkv, D)`` (a strided view)."""
        return self.storage[:, layer]

    @property
    def page_bytes(self) -> int:
        return self.config.page_bytes

    @property
    def base_address(self) -> int:
        return self.kv.data_ptr()

    def page_address(self, page_id: int) -> int:
        return self.base_address + page_id * self.page_bytes

    def page(self, page_id: int) -> torch.Tensor:
        """One page's whole content, ``(L, 2, page, Hkv, D)`` (a view)."""
        return self.kv[page_id]


class PageAllocator:
    """Free list plus reference counts. Single writer: the engine's event loop."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() yields low ids first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"need {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"incref of free page {p}")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference from each page; pages reaching zero return to the free list."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"double free of page {p}")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def check_integrity(self) -> None:
        """Idle-time check: every page is either free (ref 0) or referenced, never both."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("page listed twice in free list")
        for p, r in enumerate(self._refs):
            if (r == 0) != (p in free):
                raise AssertionError(f"page {p}: refs={r}, free={p in free}")
