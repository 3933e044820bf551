"""Triton paged decode attention against the torch reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.paged_attention import reference_paged_decode_attention
from tests.kernels.triton.helpers import readable, scattered_pool

triton_decode = pytest.importorskip("pdserve.kernels.triton.decode")

# One token, exactly a page, one past a page, ragged, and longer than several splits' blocks.
LENS = [1, 16, 17, 5, 70]


def _decode(
    device: str, dtype: torch.dtype, group: int, head_dim: int, window: int | None,
    num_splits: int, page_size: int = 16, num_kv_heads: int = 2, lens: list[int] = LENS,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    gen = torch.Generator().manual_seed(group * head_dim + num_splits)
    setup = scattered_pool(lens, page_size, num_kv_heads, head_dim, dtype, device, gen)
    # q is a strided view, as in the model (the query heads of a fused QKV output).
    qkv = torch.randn(len(lens), (group + 2) * num_kv_heads, head_dim, generator=gen)
    q = qkv.to(dtype).to(device)[:, : group * num_kv_heads]
    context_lens = torch.tensor(lens, device=device)
    width = torch.tensor([setup.block_table.shape[1]], device=device)
    scale = head_dim**-0.5
    out = triton_decode.paged_decode_attention(
        q, setup.layer_pool, setup.block_table, width, context_lens, scale, window, num_splits
    )
    ref = reference_paged_decode_attention(
        q.float(), readable(setup.layer_pool), setup.block_table, context_lens, scale, window
    )
    assert out.dtype == dtype and out.shape == q.shape
    return out.float(), ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_torch_reference_over_scattered_pages(
    device: str, dtype: torch.dtype, group: int, head_dim: int
) -> None:
    out, ref = _decode(device, dtype, group, head_dim, None, num_splits=4)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_decode_sliding_window_sees_only_the_last_keys(device: str, window: int) -> None:
    out, ref = _decode(device, torch.float32, 4, 64, window, num_splits=4, page_size=4)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2, 16])
def test_decode_split_count_does_not_change_the_result(device: str, num_splits: int) -> None:
    """16 splits leave most of a short context's splits empty: the merge must skip them."""
    out, ref = _decode(device, torch.float32, 2, 64, None, num_splits)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_decode_every_length_up_to_a_few_pages(device: str) -> None:
    lens = list(range(1, 14))
    out, ref = _decode(
        device, torch.float32, 2, 64, None, 2, page_size=4, num_kv_heads=1, lens=lens
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_decode_reads_the_table_width_from_the_device(device: str) -> None:
    """A table stored with a wider row stride (a graph's static buffer) and the width tensor
    saying so gives the same result as the tight table."""
    gen = torch.Generator().manual_seed(3)
    lens = [3, 9]
    setup = scattered_pool(lens, 4, 1, 64, torch.float32, device, gen)
    q = torch.randn(2, 2, 64, generator=gen).to(device)
    context_lens = torch.tensor(lens, device=device)
    tight = setup.block_table  # (2, 3)
    wide = torch.full((2, 7), setup.scratch_page, device=device)
    wide[:, :3] = tight
    args = (context_lens, 0.125, None, 2)
    out_tight = triton_decode.paged_decode_attention(
        q, setup.layer_pool, tight, torch.tensor([3], device=device), *args
    )
    out_wide = triton_decode.paged_decode_attention(
        q, setup.layer_pool, wide, torch.tensor([7], device=device), *args
    )
    torch.testing.assert_close(out_wide, out_tight, atol=0, rtol=0)


def test_num_splits_fill_the_device_for_one_sequence_and_stay_powers_of_two() -> None:
    assert triton_decode.num_splits_for(8, 132) == 16  # capped: 33 wanted
    assert triton_decode.num_splits_for(32, 132) == 16  # 9 wanted
    assert triton_decode.num_splits_for(64, 16) == 1
    for num_kv_heads in (1, 3, 7, 33):
        splits = triton_decode.num_splits_for(num_kv_heads, 132)
        assert splits & (splits - 1) == 0


def test_decode_head_dim_that_is_not_a_power_of_two(device: str) -> None:
    out, ref = _decode(device, torch.float32, 2, 80, None, num_splits=2, lens=[3, 21])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
