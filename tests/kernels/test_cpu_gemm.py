"""The bf16 CPU kernel equals a float32 product of the same bf16 weights, for any shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_ext, cpu_gemm

pytestmark = pytest.mark.usefixtures("cpu_kernels")  # skips where the kernels cannot run


def _packed(w: torch.Tensor) -> cpu_gemm.PackedDenseWeight:
    return cpu_gemm.PackedDenseWeight(cpu_ext.load(), w)


# rows 1..13 cover every row-group split (1, 2..6, 7 = 4 + 3, 8 = 4 + 4, 13 = 5 + 4 + 4);
# N and K off the 16 / 2 multiples cover the padded last panel and the odd k tail.
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 13, 40])
@pytest.mark.parametrize(("n", "k"), [(16, 8), (37, 19), (300, 256), (1, 1)])
def test_matches_float32_product_of_the_bf16_weights(rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    out = _packed(w)(x, bias, torch.float32)
    expected = F.linear(x, w.float(), bias)
    torch.testing.assert_close(out, expected, atol=1e-4 * k**0.5, rtol=1e-5)


def test_bf16_output_is_the_rounded_float32_result() -> None:
    w = torch.randn(50, 64).bfloat16()
    x = torch.randn(4, 64).bfloat16()
    packed = _packed(w)
    exact = packed(x, None, torch.float32)
    rounded = packed(x, None, torch.bfloat16)
    assert rounded.dtype == torch.bfloat16
    assert torch.equal(rounded, exact.to(torch.bfloat16))


def test_keeps_leading_dimensions() -> None:
    w = torch.randn(24, 32).bfloat16()
    x = torch.randn(2, 3, 32).bfloat16()
    out = _packed(w)(x, None, torch.bfloat16)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out[1, 2], _packed(w)(x[1, 2:3], None, torch.bfloat16)[0])


def test_each_row_is_independent_of_its_batch() -> None:
    """Batch invariance: a row's result does not depend on which rows share the call."""
    w = torch.randn(100, 96).bfloat16()
    x = torch.randn(9, 96).bfloat16()
    packed = _packed(w)
    together = packed(x, None, torch.float32)
    alone = torch.cat([packed(x[i : i + 1], None, torch.float32) for i in range(9)])
    torch.testing.assert_close(together, alone, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_give_the_same_result_as_contiguous_ones(dtype: torch.dtype) -> None:
    """Rows are converted inside the kernel; views (row gaps, transposes) must read right."""
    w = torch.randn(40, 24).bfloat16()
    wide = torch.randn(5, 40).to(dtype)
    packed = _packed(w)
    contiguous = packed(wide[:, 3:27].contiguous(), None, torch.float32)
    assert torch.equal(packed(wide[:, 3:27], None, torch.float32), contiguous)
    tall = wide[:, 3:27].t().contiguous().t()  # column-major rows
    assert torch.equal(packed(tall, None, torch.float32), contiguous)


def test_packed_weights_start_on_a_huge_page_and_outlive_their_source() -> None:
    """Packed weights get memory of their own, 2 MiB aligned so the OS can back it with huge
    pages; it stays valid after the source weight is gone and is unmapped when freed."""
    w = torch.randn(300, 256).bfloat16()
    expected = _packed(w)(torch.ones(1, 256), None, torch.float32)
    packed = _packed(w.clone())
    assert packed.packed.data_ptr() % (2 << 20) == 0
    for _ in range(50):  # repeated packs and frees: each mapping is returned, none reused wrongly
        _packed(torch.randn(300, 256).bfloat16())
    assert torch.equal(packed(torch.ones(1, 256), None, torch.float32), expected)
