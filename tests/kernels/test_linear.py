"""Linear: one kernel for every row count; a row's output bits never depend on its batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from pdserve.kernels import cpu_ext
from pdserve.kernels.linear import Linear
from pdserve.model.quantized import QuantizedTensor

# The C++ module is loaded by the tests that run, never at import: a GPU run collects this
# file and must not build the CPU kernels.
needs_kernel = pytest.mark.usefixtures("kernel")


def has_kernel() -> bool:
    return cpu_ext.load() is not None


@pytest.fixture
def kernel() -> None:
    if not has_kernel():
        pytest.skip("the C++ CPU kernels do not run here")


ROW_COUNTS = (1, 3, 8, 64, 300)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_float32_rows_match_the_float64_product_of_the_stored_weights(
    weight_dtype: torch.dtype,
) -> None:
    w, b = torch.randn(40, 72, dtype=weight_dtype), torch.randn(40)
    x = torch.randn(5, 72)
    out = Linear(w, b, torch.float32)(x)
    assert out.dtype == torch.float32
    expected = F.linear(x.double(), w.double(), b.double()).float()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_a_row_has_the_same_bits_at_every_row_count(weight_dtype: torch.dtype) -> None:
    """The row alone, among 3 or 8 decode rows, in a 64-row chunk and in a 300-row prompt (row
    blocks and thread chunks differ across these) gives one result, bit for bit."""
    torch.manual_seed(0)
    lin = Linear(torch.randn(200, 96, dtype=weight_dtype), torch.randn(200), torch.float32)
    row = torch.randn(1, 96)
    alone = lin(row)
    for num_rows in ROW_COUNTS[1:]:
        for at in (0, num_rows // 2, num_rows - 1):
            batch = torch.randn(num_rows, 96)
            batch[at] = row[0]
            assert torch.equal(lin(batch)[at], alone[0]), (num_rows, at)


@needs_kernel
def test_the_thread_count_does_not_change_a_row() -> None:
    lin = Linear(torch.randn(512, 128, dtype=torch.bfloat16), None, torch.float32)
    x = torch.randn(64, 128)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(2)
        two = lin(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_without_the_kernel_torch_runs_in_the_activation_dtype() -> None:
    w, b = torch.randn(6, 8, dtype=torch.bfloat16), torch.randn(6, dtype=torch.bfloat16)
    x = torch.randn(3, 8)
    lin = Linear(w, b, torch.float32, use_kernel=False)
    assert lin.kernel is None
    assert torch.equal(lin(x), F.linear(x, w.float(), b.float()))


def test_num_bytes_counts_the_weight_as_it_runs() -> None:
    assert Linear(torch.randn(6, 8, dtype=torch.bfloat16), use_kernel=False).num_bytes == 6 * 8 * 2
    lin = Linear(torch.randn(20, 4, dtype=torch.bfloat16))
    if lin.kernel is not None:  # packed into 2 panels of 16 columns, zero padded
        assert lin.num_bytes == 32 * 4 * 2


def test_kernel_is_used_for_bf16_and_float32_weights_where_the_cpu_supports_it() -> None:
    assert (Linear(torch.randn(16, 8, dtype=torch.bfloat16)).kernel is not None) == has_kernel()
    assert (Linear(torch.randn(16, 8)).kernel is not None) == has_kernel()


def _q8_parts() -> list[QuantizedTensor]:
    rng = np.random.default_rng(0)
    parts = []
    for n in (24, 8):
        dense = rng.standard_normal((n, 64)).astype(np.float32)
        data = quantize(dense, GGMLQuantizationType.Q8_0).view(np.uint8).reshape(n, -1)
        parts.append(QuantizedTensor("Q8_0", (n, 64), np.ascontiguousarray(data)))
    return parts


@needs_kernel
def test_quantized_parts_stay_packed_and_keep_the_input_dtype() -> None:
    parts = _q8_parts()
    bias = torch.randn(32)
    lin = Linear(parts, bias)
    assert lin.quant is not None and lin.weight is None and lin.num_bytes == lin.quant.num_bytes
    x = torch.randn(3, 64)
    dense = torch.cat([p.dequantize() for p in parts])
    torch.testing.assert_close(lin(x), F.linear(x, dense, bias), atol=1e-4, rtol=1e-5)
    assert lin(x.bfloat16()).dtype == torch.bfloat16


def test_quantized_weight_without_the_kernel_is_dequantized_to_bf16() -> None:
    parts = _q8_parts()
    lin = Linear(parts, None, use_kernel=False)
    assert lin.quant is None
    assert torch.equal(lin.weight, torch.cat([p.dequantize(torch.bfloat16) for p in parts]))
