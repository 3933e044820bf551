"""The paged KV cache: one page-major tensor plus a page allocator.

Layout (page-major, head-major inside a page):
``(num_pages, num_kv_heads, num_layers, 2, page_size, head_dim)``. All layers' K and V of one
page are contiguous, so a room's KV transfer is one NIXL descriptor per page, and runs of
adjacent pages coalesce into one descriptor. Inside a page each KV head's layers are one
contiguous run, so a tensor-parallel rank's heads are a plain slice of the pool
(:meth:`KVPagePool.head_view`): one engine pool holds every rank's heads and a page has the
same bytes at every TP size. The same tensor is what the model runner reads and writes and
what the transport registers with NIXL.

One extra **scratch page** follows the allocator's ``num_pages`` in the same storage: padded
rows of a batch (CUDA-graph buckets, block-table padding) read and write it, so padding never
touches a live page. No sequence owns it; the allocator, the transport's page ids and the
registered tensor (:attr:`KVPagePool.kv`) do not include it, while the per-layer views the
attention kernels read (:meth:`KVPagePool.layer_view`) do.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
from collections import OrderedDict
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


def pool_shape(c: KVCacheConfig) -> tuple[int, ...]:
    """The storage's shape: the allocator's pages and the scratch page."""
    return (c.num_pages + 1, c.num_kv_heads, c.num_layers, 2, c.page_size, c.head_dim)


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
        self, config: KVCacheConfig, device: str | torch.device = "cpu", hugepages: bool = True,
        storage: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        c = config
        if storage is not None:  # shared by the engine's tensor-parallel ranks (parallel/)
            if storage.shape != pool_shape(c):
                raise ValueError(f"KV storage {tuple(storage.shape)} != {pool_shape(c)}")
            self.storage = storage
        elif torch.device(device).type == "cpu" and hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
            self.storage = hugepage_zeros(pool_shape(c), c.dtype)  # (P + 1, Hkv, L, 2, page, D)
        else:
            self.storage = torch.zeros(pool_shape(c), dtype=c.dtype, device=device)
        # The allocator's pages (a contiguous prefix of the storage): what NIXL registers.
        self.kv = self.storage[: c.num_pages]  # (P, Hkv, L, 2, page, D)

    @property
    def scratch_page(self) -> int:
        """The page id padded batch rows point at (never allocated, never transferred)."""
        return self.config.num_pages

    def layer_view(self, layer: int) -> torch.Tensor:
        """One layer's K and V pages, the scratch page included,
        ``(num_pages + 1, 2, page_size, Hkv, D)`` (a strided view: the kernels take strides)."""
        return self.storage[:, :, layer].permute(0, 2, 3, 1, 4)

    def head_view(self, heads: range) -> KVPagePool:
        """The pool of KV heads ``heads`` only, over the same memory and page ids (a
        tensor-parallel rank's share; strided, so never what the transport registers)."""
        view = KVPagePool.__new__(KVPagePool)
        view.config = dataclasses.replace(self.config, num_kv_heads=len(heads))
        view.storage = self.storage[:, heads.start : heads.stop]
        view.kv = view.storage[: self.config.num_pages]
        return view

    @property
    def page_bytes(self) -> int:
        return self.config.page_bytes

    @property
    def base_address(self) -> int:
        return self.kv.data_ptr()

    def page_address(self, page_id: int) -> int:
        return self.base_address + page_id * self.page_bytes

    def page(self, page_id: int) -> torch.Tensor:
        """One page's whole content, ``(Hkv, L, 2, page, D)`` (a view)."""
        return self.kv[page_id]


class PageAllocator:
    """Pages by reference count, with a prefix cache's pages kept until the space is needed.

    Every page is in exactly one of three states: free (empty, ref 0), cached (ref 0 but holding
    the KV of a full page registered under a key by :meth:`cache_page`; evicted least recently
    released first when :meth:`allocate` runs out of free pages) or referenced (ref >= 1, keyed
    or not). A keyed page's content is final: its owners only read it. Single writer: the
    engine's event loop.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() yields low ids first
        self._refs = [0] * num_pages
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref-0 keyed pages, LRU first
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Empty pages (neither referenced nor holding cached KV)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages referenced by nobody that hold cached KV (reclaimable). Idle: free + cached
        == total."""
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages referenced by at least one sequence, room or transfer."""
        return self.num_pages - len(self._free) - len(self._evictable)

    @property
    def num_available(self) -> int:
        """Pages :meth:`allocate` can hand out: free ones, then cached ones by eviction."""
        return len(self._free) + len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_available

    def allocate(self, n: int) -> list[int]:
        """``n`` pages with one reference each; evicts cached pages (LRU) once none are free."""
        if n > self.num_available:
            raise MemoryError(f"need {n} KV pages, {self.num_available} free or cached")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:
                p, _ = self._evictable.popitem(last=False)
                del self._page_of[self._key_of.pop(p)]
                self.num_evictions += 1
            self._refs[p] = 1
            pages.append(p)
        return pages

    def incref(self, pages: list[int]) -> None:
        """One more reference each; a cached page leaves the eviction list."""
        for p in pages:
            if self._refs[p] == 0:
                if p not in self._evictable:
                    raise ValueError(f"incref of free page {p}")
                del self._evictable[p]
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference from each page; at zero a keyed page is cached, others are free."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"double free of page {p}")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if p in self._key_of:
                    self._evictable[p] = None  # most recently released: evicted last
                else:
                    self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    # ---- prefix cache keys -----------------------------------------------------------------
    def cache_page(self, page: int, key: bytes) -> bool:
        """Register a referenced, fully written page under ``key``; False (nothing changes) when
        the key is already held by another page or the page already has a key."""
        if self._refs[page] <= 0:
            raise ValueError(f"cache_page of unreferenced page {page}")
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    def cached_page(self, key: bytes) -> int | None:
        return self._page_of.get(key)

    def is_keyed(self, page: int) -> bool:
        return page in self._key_of

    def check_integrity(self) -> None:
        """Every page is in exactly one state; keys map pages one to one."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("page listed twice in free list")
        if free & self._evictable.keys():
            raise AssertionError("page both free and cached")
        for p, r in enumerate(self._refs):
            if (r == 0) != (p in free or p in self._evictable):
                raise AssertionError(f"page {p}: refs={r}, free={p in free}")
        if any(p not in self._key_of for p in self._evictable):
            raise AssertionError("cached page without a key")
        if {k: p for p, k in self._key_of.items()} != self._page_of:
            raise AssertionError("key maps disagree")
