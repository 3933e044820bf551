"""Paged decode attention: the C++ kernel against the torch reference (gather + mask + SDPA)."""

from __future__ import annotations

import types

import pytest
import torch

from pdserve.kernels.paged_attention import (
    load_kernel,
    paged_decode_attention,
    reference_paged_decode_attention,
)

needs_kernel = pytest.mark.usefixtures("cpu_kernels")  # skips where the kernels cannot run

PAGE, NUM_LAYERS, LAYER = 16, 2, 1


def cpu_kernels_module() -> types.ModuleType | None:
    return load_kernel(torch.float32, 64)  # loaded when a test runs (cpu_ext.load is cached)


# 1 token, exactly one page, one past a page, a ragged middle, and a long context.
LENS = [1, PAGE, PAGE + 1, 2 * PAGE, 45, 1000]


def _setup(
    lens: list[int], num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, one layer's pool view, a block table of scattered pages (padded with page 0), lens."""
    gen = torch.Generator().manual_seed(seed)
    max_pages = -(-max(lens) // PAGE)
    num_pages = sum(-(-n // PAGE) for n in lens) + 3
    pool = torch.randn(num_pages, NUM_LAYERS, 2, PAGE, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_pages - 1, generator=gen) + 1  # page 0 is only padding
    rows, used = [], 0
    for n in lens:
        count = -(-n // PAGE)
        rows.append(order[used : used + count].tolist() + [0] * (max_pages - count))
        used += count
    # q is a strided view, as in the model (the query heads of a fused QKV output).
    qkv = torch.randn(len(lens), (group + 2) * num_kv_heads, head_dim, generator=gen)
    q = qkv[:, : group * num_kv_heads]
    return q.to(dtype), pool.to(dtype)[:, LAYER], torch.tensor(rows), torch.tensor(lens)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 7, 40])
def test_kernel_matches_torch_reference(
    dtype: torch.dtype, group: int, head_dim: int, window: int | None
) -> None:
    q, pool, table, lens = _setup(LENS, 2, group, head_dim, dtype, seed=group * head_dim)
    scale = head_dim**-0.5
    out = paged_decode_attention(cpu_kernels_module(), q, pool, table, lens, scale, window)
    # The reference runs in float32 on the same (possibly bf16-rounded) inputs.
    ref = reference_paged_decode_attention(q.float(), pool.float(), table, lens, scale, window)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_fallback_without_kernel_is_the_torch_reference() -> None:
    q, pool, table, lens = _setup([3, 20], 2, 2, 16, torch.float32, seed=1)
    out = paged_decode_attention(None, q, pool, table, lens, 0.25, 8)
    assert torch.equal(out, reference_paged_decode_attention(q, pool, table, lens, 0.25, 8))


@needs_kernel
def test_unsupported_head_dims_and_dtypes_use_torch() -> None:
    assert load_kernel(torch.float16, 64) is None
    assert load_kernel(torch.bfloat16, 72) is None  # not a multiple of 16
    assert load_kernel(torch.bfloat16, 128) is cpu_kernels_module()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_result_does_not_depend_on_its_batch_mates(dtype: torch.dtype) -> None:
    q, pool, table, lens = _setup(LENS, 2, 4, 64, dtype, seed=5)
    together = paged_decode_attention(cpu_kernels_module(), q, pool, table, lens, 0.125)
    for b in range(len(LENS)):
        alone = paged_decode_attention(
            cpu_kernels_module(), q[b : b + 1], pool, table[b : b + 1], lens[b : b + 1], 0.125
        )
        assert torch.equal(alone[0], together[b]), b


@needs_kernel
def test_results_are_equal_with_one_and_two_threads() -> None:
    # Big enough (8 x 400 keys x 8 heads) that the kernel splits work between threads.
    q, pool, table, lens = _setup([400] * 4 + [399, 17, 1, 260], 2, 4, 64, torch.bfloat16, 6)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_decode_attention(cpu_kernels_module(), q, pool, table, lens, 0.125)
        torch.set_num_threads(2)
        two = paged_decode_attention(cpu_kernels_module(), q, pool, table, lens, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_slots_past_the_context_and_padding_pages_are_never_read() -> None:
    q, pool, table, lens = _setup([5, 33, 2], 2, 2, 64, torch.float32, seed=7)
    expected = paged_decode_attention(cpu_kernels_module(), q, pool, table, lens, 0.125, 20)
    poisoned = pool.clone()
    for b, n in enumerate(lens.tolist()):
        start = max(0, n - 20)  # keys before the window are hidden too
        keep = [(int(table[b, p // PAGE]), p % PAGE) for p in range(start, n)]
        saved = {slot: poisoned[slot[0], :, slot[1]].clone() for slot in keep}
        for p in range(-(-n // PAGE)):
            poisoned[int(table[b, p])] = float("nan")
        for (page, offset), kv in saved.items():
            poisoned[page, :, offset] = kv
    poisoned[0] = float("nan")  # the padding page
    got = paged_decode_attention(cpu_kernels_module(), q, poisoned, table, lens, 0.125, 20)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_new_tokens_are_stored_in_their_slots_before_attending(use_kernel: bool) -> None:
    if use_kernel and cpu_kernels_module() is None:
        pytest.skip("kernel needs AVX2 and a C++ compiler")
    q, pool, table, lens = _setup([1, 16, 17, 30], 2, 2, 64, torch.bfloat16, seed=9)
    new_kv = torch.randn(4, 2, 2, 64).bfloat16()
    stored = pool.clone()
    for b, n in enumerate(lens.tolist()):
        stored[int(table[b, (n - 1) // PAGE]), :, (n - 1) % PAGE] = new_kv[b]
    expected = reference_paged_decode_attention(q, stored.clone(), table, lens, 0.125)
    out = paged_decode_attention(
        cpu_kernels_module() if use_kernel else None, q, pool, table, lens, 0.125, new_kv=new_kv
    )
    assert torch.equal(pool, stored)
    tol = 1e-2 if use_kernel else 0.0
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@needs_kernel
def test_out_of_range_lengths_and_pages_are_rejected() -> None:
    q, pool, table, lens = _setup([5, 9], 1, 2, 64, torch.float32, seed=8)
    with pytest.raises(RuntimeError, match="context length"):
        paged_decode_attention(cpu_kernels_module(), q, pool, table, torch.tensor([5, 0]), 0.125)
    bad = table.clone()
    bad[1, 0] = pool.shape[0]
    with pytest.raises(RuntimeError, match="outside the pool"):
        paged_decode_attention(cpu_kernels_module(), q, pool, bad, lens, 0.125)
