"""The page pool's scratch page: beyond the allocator's pages, outside what NIXL registers."""

from __future__ import annotations

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
    assert pool.page(2)[0, 1, 3].sum() == 8
