"""DecodeContext: per-step K/V copies equal per-layer page gathers plus the new token."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.attention import gather_pages
from pdserve.kernels.decode_context import DecodeContext

PAGES, LAYERS, PAGE, KV_HEADS, DIM = 10, 3, 4, 2, 8


@pytest.mark.parametrize("max_gather_bytes", [1 << 30, 1])  # all layers at once / one by one
def test_layer_copies_match_page_gathers_with_new_token_inserted(max_gather_bytes: int) -> None:
    torch.manual_seed(0)
    pool = torch.randn(PAGES, KV_HEADS, LAYERS, 2, PAGE, DIM)  # kernels/kv_cache.py's layout
    block_table = torch.tensor([[7, 2, 0], [4, 9, 5]])
    context_lens = torch.tensor([6, 12])
    ctx = DecodeContext(pool, block_table, context_lens, max_gather_bytes)
    assert ctx.num_layers_per_gather == (LAYERS if max_gather_bytes > 1 else 1)
    for layer in range(LAYERS):
        new_k, new_v = torch.randn(2, KV_HEADS, DIM), torch.randn(2, KV_HEADS, DIM)
        keys, values = ctx.layer(layer, torch.stack([new_k, new_v], dim=1))
        view = pool[:, :, layer].permute(0, 2, 3, 1, 4)  # (pages, 2, page, Hkv, D)
        expected_k = gather_pages(view[:, 0], block_table)
        expected_v = gather_pages(view[:, 1], block_table)
        for b, n in enumerate(context_lens.tolist()):
            expected_k[b, n - 1], expected_v[b, n - 1] = new_k[b], new_v[b]
        assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)
    assert pool.abs().sum() > 0 and not torch.equal(pool[7, :, 0, 0, 1], new_k[0])  # pool untouched
