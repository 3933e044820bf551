"""The page pool (its scratch page beyond the allocator's pages, outside what NIXL registers)
and the PageAllocator (reference counts, cached pages kept until needed, LRU eviction)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.kernels.kv_cache import KVCacheConfig, KVPagePool, PageAllocator

CONFIG = KVCacheConfig(num_layers=2, num_kv_heads=1, head_dim=8, num_pages=6, page_size=4)


def test_scratch_page_follows_the_allocator_pages(device: str) -> None:
    pool = KVPagePool(CONFIG, device=device)
    assert pool.scratch_page == CONFIG.num_pages
    assert pool.kv.shape[0] == CONFIG.num_pages  # what the transport registers and describes
    assert pool.kv.is_contiguous() and pool.kv.data_ptr() == pool.storage.data_ptr()
    assert pool.layer_view(1).shape == (CONFIG.num_pages + 1, 2, 4, 1, 8)
    pool.layer_view(1)[pool.scratch_page] = 1.0
    assert pool.kv.abs().sum() == 0  # a write to the scratch page touches no real page
    assert pool.page_address(CONFIG.num_pages - 1) + pool.page_bytes == (
        pool.storage[pool.scratch_page].data_ptr()
    )


def test_allocator_never_hands_out_the_scratch_page() -> None:
    allocator = PageAllocator(CONFIG.num_pages)
    assert KVPagePool(CONFIG).scratch_page not in allocator.allocate(CONFIG.num_pages)


def test_layer_view_is_a_view_of_the_storage() -> None:
    pool = KVPagePool(CONFIG, hugepages=False)
    pool.layer_view(0)[2, 1, 3] = torch.ones(1, 8, dtype=CONFIG.dtype)
    assert pool.page(2)[:, 0, 1, 3].sum() == 8  # (Hkv, L, 2, page, D): head-major


def test_a_head_view_is_a_slice_of_every_page_of_the_engine_pool() -> None:
    """A tensor-parallel rank's heads: its writes land in the engine pool's pages, inside
    each page one contiguous run per head (the bytes a transfer moves are the TP1 page)."""
    config = dataclasses.replace(CONFIG, num_kv_heads=4)
    pool = KVPagePool(config, hugepages=False)
    rank = pool.head_view(range(2, 4))
    assert rank.config.num_kv_heads == 2 and rank.scratch_page == pool.scratch_page
    rank.layer_view(1)[5, 0, 2] = 3.0  # page 5, K, token 2, both of the view's heads
    assert pool.page(5)[2:4, 1, 0, 2].eq(3.0).all() and pool.page(5)[:2].eq(0).all()
    head_run = pool.page(5)[2]
    assert head_run.is_contiguous() and head_run.numel() == pool.page(5).numel() // 4


def test_keyed_page_is_cached_not_freed_when_released_and_found_again():
    a = PageAllocator(4)
    [p] = a.allocate(1)
    assert a.cache_page(p, b"k")
    a.free([p])
    assert (a.num_free, a.num_cached, a.num_used) == (3, 1, 0)
    assert a.cached_page(b"k") == p
    a.incref([p])  # reused: off the eviction list
    assert (a.num_cached, a.num_used, a.refcount(p)) == (0, 1, 1)
    a.check_integrity()


def test_cached_pages_are_evicted_least_recently_released_first_and_only_when_needed():
    a = PageAllocator(3)
    pages = a.allocate(3)
    for i, p in enumerate(pages):
        a.cache_page(p, bytes([i]))
    a.free([pages[1]])
    a.free([pages[0]])
    a.free([pages[2]])
    assert a.num_cached == 3 and a.can_allocate(3)
    [got] = a.allocate(1)
    assert got == pages[1] and a.cached_page(bytes([1])) is None  # released first
    assert a.cached_page(bytes([0])) == pages[0] and a.num_evictions == 1
    a.check_integrity()


def test_free_pages_go_before_cached_ones():
    a = PageAllocator(2)
    p, q = a.allocate(2)
    a.cache_page(p, b"p")
    a.free([p, q])
    assert a.allocate(1) == [q] and a.cached_page(b"p") == p


def test_a_key_names_one_page_and_a_page_one_key():
    a = PageAllocator(2)
    p, q = a.allocate(2)
    assert a.cache_page(p, b"k")
    assert not a.cache_page(q, b"k")  # the same prefix computed twice: q stays unkeyed
    assert not a.cache_page(p, b"other")
    a.free([p, q])
    assert (a.num_free, a.num_cached) == (1, 1)


def test_refcount_misuse_raises():
    a = PageAllocator(2)
    [p] = a.allocate(1)
    a.free([p])
    with pytest.raises(ValueError, match="double free"):
        a.free([p])
    with pytest.raises(ValueError, match="incref of free"):
        a.incref([p])
    with pytest.raises(ValueError, match="unreferenced"):
        a.cache_page(p, b"k")
    with pytest.raises(MemoryError):
        a.allocate(3)
