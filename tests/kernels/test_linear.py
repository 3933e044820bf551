"""Linear: few rows go to the bf16 kernel (or torch), many rows to float32; the dtype is kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_ext, linear
from pdserve.kernels.linear import Linear


def test_rows_below_threshold_match_the_float32_product() -> None:
    w, b = torch.randn(6, 8, dtype=torch.bfloat16), torch.randn(6, dtype=torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    expected = F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16)
    torch.testing.assert_close(Linear(w, b, fp32_min_rows=4)(x), expected, atol=1e-2, rtol=1e-2)


def test_without_the_kernel_few_rows_use_the_weight_as_is() -> None:
    w, b = torch.randn(6, 8, dtype=torch.bfloat16), torch.randn(6, dtype=torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    lin = Linear(w, b, fp32_min_rows=4, use_kernel=False)
    assert lin.kernel is None
    assert torch.equal(lin(x), F.linear(x, w, b))


def test_many_rows_run_in_float32_and_return_the_input_dtype() -> None:
    w, b = torch.randn(6, 8, dtype=torch.bfloat16), torch.randn(6, dtype=torch.bfloat16)
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    lin = Linear(w, b, fp32_min_rows=4, use_kernel=False)
    out = lin(x)
    expected = F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)  # one bf16 rounding apart
    assert lin.num_extra_bytes == (6 * 8 + 6) * 4


def test_extra_bytes_count_the_packed_and_float32_copies() -> None:
    assert Linear(torch.randn(4, 4), fp32_min_rows=1).num_extra_bytes == 0
    assert Linear(torch.randn(4, 4, dtype=torch.bfloat16), use_kernel=False).num_extra_bytes == 0
    lin = Linear(torch.randn(20, 4, dtype=torch.bfloat16))
    if lin.kernel is not None:  # packed into 2 panels of 16 columns, zero padded
        assert lin.num_extra_bytes == 32 * 4 * 2


def test_packed_float32_path_matches_plain_float32_gemm_for_any_leading_shape() -> None:
    w, b = torch.randn(300, 256, dtype=torch.bfloat16), torch.randn(300, dtype=torch.bfloat16)
    lin = Linear(w, b, fp32_min_rows=8)
    for shape in ((8, 256), (33, 256), (4, 9, 256)):
        x = torch.randn(*shape, dtype=torch.bfloat16)
        plain = F.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(lin._linear_f32(x.float()), plain, atol=1e-4, rtol=1e-5)


def test_kernel_is_used_for_bf16_weights_where_the_cpu_supports_it() -> None:
    lin = Linear(torch.randn(16, 8, dtype=torch.bfloat16))
    assert (lin.kernel is not None) == (cpu_ext.load() is not None)
    assert Linear(torch.randn(16, 8)).kernel is None  # float32 weights: torch is fine


def test_float32_switch_depends_on_whether_the_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on an AVX2 CPU switches to float32 copies later with the kernel than with torch's
    bf16 matmul, and a decode-only worker with the kernel makes none; float32 models and CPUs
    with native bf16 GEMM never make copies."""
    cpu = torch.device("cpu")
    assert linear.auto_fp32_min_rows(cpu, torch.float32) is None
    if linear.has_fast_bf16_matmul(cpu):
        assert linear.auto_fp32_min_rows(cpu, torch.bfloat16) is None
        return
    monkeypatch.setattr(linear.cpu_ext, "load", lambda: None)
    without_kernel = linear.FP32_MIN_ROWS_VS_TORCH_BF16
    assert linear.auto_fp32_min_rows(cpu, torch.bfloat16) == without_kernel
    assert linear.auto_fp32_min_rows(cpu, torch.bfloat16, prefills_prompts=False) == without_kernel
    monkeypatch.setattr(linear.cpu_ext, "load", lambda: object())
    assert linear.auto_fp32_min_rows(cpu, torch.bfloat16) == linear.FP32_MIN_ROWS_VS_KERNEL
    assert linear.FP32_MIN_ROWS_VS_TORCH_BF16 < linear.FP32_MIN_ROWS_VS_KERNEL
    # A decode-only worker with the kernel: no copies (its batches stay below the switch).
    assert linear.auto_fp32_min_rows(cpu, torch.bfloat16, prefills_prompts=False) is None


def _q8_parts() -> list:
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from pdserve.model.quantized import QuantizedTensor

    rng = np.random.default_rng(0)
    parts = []
    for n in (24, 8):
        dense = rng.standard_normal((n, 64)).astype(np.float32)
        data = quantize(dense, GGMLQuantizationType.Q8_0).view(np.uint8).reshape(n, -1)
        parts.append(QuantizedTensor("Q8_0", (n, 64), np.ascontiguousarray(data)))
    return parts


@pytest.mark.skipif(cpu_ext.load() is None, reason="kernel needs AVX2 and a C++ compiler")
def test_quantized_parts_stay_packed_and_keep_the_input_dtype() -> None:
    parts = _q8_parts()
    bias = torch.randn(32)
    lin = Linear(parts, bias, fp32_min_rows=4)
    assert lin.quant is not None and lin.num_extra_bytes == lin.quant.num_bytes
    x = torch.randn(3, 64)
    dense = torch.cat([p.dequantize() for p in parts])
    torch.testing.assert_close(lin(x), F.linear(x, dense, bias), atol=1e-4, rtol=1e-5)
    assert lin(x.bfloat16()).dtype == torch.bfloat16


def test_quantized_weight_without_the_kernel_is_dequantized_to_bf16() -> None:
    parts = _q8_parts()
    lin = Linear(parts, None, use_kernel=False)
    assert lin.quant is None
    assert torch.equal(lin.weight, torch.cat([p.dequantize(torch.bfloat16) for p in parts]))
