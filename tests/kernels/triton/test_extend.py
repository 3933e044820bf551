"""Triton extend (prefill over a cached prefix) attention against the torch reference."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.attention import PrefillSeqMeta, prefill_attention, write_layer_kv
from tests.kernels.triton.helpers import readable, scattered_pool

triton_extend = pytest.importorskip("pdserve.kernels.triton.extend")

# (cached, new): a fresh prompt, one token after a prefix, a prompt longer than a query block,
# an extend crossing page boundaries, and exactly one page.
SEQS = [(0, 5), (7, 1), (0, 40), (13, 30), (0, 16)]


def _extend(
    device: str, dtype: torch.dtype, group: int, head_dim: int, window: int | None,
    page_size: int = 16, num_kv_heads: int = 2, seqs: list[tuple[int, int]] = SEQS,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    gen = torch.Generator().manual_seed(group * head_dim + page_size)
    lens = [c + n for c, n in seqs]
    setup = scattered_pool(lens, page_size, num_kv_heads, head_dim, dtype, device, gen)
    num_tokens = sum(n for _, n in seqs)
    qkv = torch.randn(num_tokens, (group + 2) * num_kv_heads, head_dim, generator=gen)
    qkv = qkv.to(dtype).to(device)
    q = qkv[:, : group * num_kv_heads]  # strided, as in the model
    new_kv = qkv[:, group * num_kv_heads :].unflatten(1, (2, num_kv_heads))
    metas, page_idx, page_offset, start = [], [], [], 0
    for i, (cached, new) in enumerate(seqs):
        pages = setup.block_table[i, : -(-(cached + new) // page_size)]
        metas.append(PrefillSeqMeta(start, new, cached, pages))
        positions = torch.arange(cached, cached + new, device=device)
        page_idx.append(pages[positions // page_size])
        page_offset.append(positions % page_size)
        start += new
    write_layer_kv(setup.layer_pool, torch.cat(page_idx), torch.cat(page_offset), new_kv)
    scale = head_dim**-0.5
    out = triton_extend.extend_attention(
        q, setup.layer_pool, setup.block_table,
        torch.tensor([m.q_start for m in metas], device=device),
        torch.tensor([n for _, n in seqs], device=device),
        torch.tensor([c for c, _ in seqs], device=device),
        max(n for _, n in seqs), scale, window,
    )  # fmt: skip
    k_cache, v_cache = readable(setup.layer_pool).unbind(1)
    new_kv = new_kv.float()
    ref = prefill_attention(
        q.float(), new_kv[:, 0], new_kv[:, 1], metas, k_cache, v_cache, scale, window
    )
    assert out.dtype == dtype and out.shape == q.shape
    return out.float(), ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_extend_matches_torch_reference_over_a_cached_prefix(
    device: str, dtype: torch.dtype, group: int, head_dim: int
) -> None:
    out, ref = _extend(device, dtype, group, head_dim, None, num_kv_heads=1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [1, 7, 33])
def test_extend_sliding_window(device: str, window: int) -> None:
    out, ref = _extend(device, torch.float32, 2, 64, window, page_size=4)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_extend_small_pages_and_every_prompt_length(device: str) -> None:
    seqs = [(0, n) for n in range(1, 10)] + [(c, 3) for c in range(1, 6)]
    out, ref = _extend(device, torch.float32, 2, 64, None, page_size=4, seqs=seqs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_extend_prompt_spanning_several_query_blocks(device: str) -> None:
    """More rows than a program's block on any device (32 here, 64 on a GPU), after a prefix."""
    out, ref = _extend(device, torch.float32, 1, 64, None, num_kv_heads=1, seqs=[(9, 150)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_extend_head_dim_that_is_not_a_power_of_two(device: str) -> None:
    out, ref = _extend(device, torch.float32, 2, 80, None, num_kv_heads=1, seqs=[(0, 7), (5, 4)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
