"""The quantized CPU matmul equals gguf's reference dequantization times the rows, and a row's
result never depends on its batch (row count, grouping, threads)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from pdserve.kernels import cpu_ext, quant_gemm
from pdserve.model.quantized import QuantizedTensor


@pytest.fixture(autouse=True)
def module() -> types.ModuleType:
    """The C++ module, loaded (built on first use) by a test that runs, never at import: a
    GPU run collects this file and must not build the CPU kernels."""
    loaded = cpu_ext.load()
    if loaded is None:
        pytest.skip("kernel needs AVX2 and a C++ compiler")
    return loaded


QUANTIZED = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
ALL_TYPES = [*QUANTIZED, "F16", "BF16", "F32"]
# Byte offsets of the f16 super-block scales in K-quant blocks (d, and dmin where there is one).
K_QUANT_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def block_k(type_name: str) -> int:
    """K's granularity: the GGUF block, and 32 for the float types (the packed record)."""
    return max(32, GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0])


def random_weight(type_name: str, n: int, k: int, seed: int) -> QuantizedTensor:
    """Valid random blocks: gguf's quantizer where it has one, else random bytes with finite
    f16 scales (gguf-py cannot quantize to K-quants)."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[type_name]
    dense = rng.standard_normal((n, k)).astype(np.float32)
    if type_name in K_QUANT_SCALES:
        block, raw_bytes = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n, k // block, raw_bytes), dtype=np.uint8)
        for offset in K_QUANT_SCALES[type_name]:
            scale = rng.uniform(-0.02, 0.02, (n, k // block)).astype(np.float16)
            raw[:, :, offset : offset + 2] = scale[..., None].view(np.uint8)
        data = raw.reshape(n, -1)
    elif type_name == "BF16":
        data = (torch.from_numpy(dense).bfloat16().view(torch.int16).numpy()).view(np.uint8)
    else:
        data = quantize(dense, qtype).view(np.uint8).reshape(n, -1)
    return QuantizedTensor(type_name, (n, k), np.ascontiguousarray(data))


def dequantized(weight: QuantizedTensor) -> torch.Tensor:
    if weight.type_name == "BF16":  # gguf's BF16 path, same bits
        return torch.from_numpy(weight.data.view(np.int16).copy()).view(torch.bfloat16).float()
    return weight.dequantize()


def packed(parts: list[QuantizedTensor]) -> quant_gemm.PackedQuantWeight:
    loaded = cpu_ext.load()
    assert loaded is not None
    return quant_gemm.PackedQuantWeight(loaded, parts)


def assert_close_to_float64(y: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> None:
    """Within the error bound of a float32 fma chain over K terms."""
    ref = x.double() @ w.double().T
    bound = x.shape[1] * 2.0**-23 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert torch.all((y.double() - ref).abs() <= bound), (y.double() - ref).abs().max()


@pytest.mark.parametrize("type_name", ALL_TYPES)
@pytest.mark.parametrize("rows", [1, 5, 13, 40])
@pytest.mark.parametrize(("n", "blocks"), [(1, 1), (16, 1), (37, 3), (70, 2)])
def test_matches_reference_dequantization(type_name: str, rows: int, n: int, blocks: int) -> None:
    k = blocks * block_k(type_name)
    weight = random_weight(type_name, n, k, seed=rows * 100 + n + blocks)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    y = packed([weight])(x)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert_close_to_float64(y, dequantized(weight), x)


@pytest.mark.parametrize("type_name", ALL_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 64])  # streaming and whole-panel paths
def test_unpacks_each_weight_bit_exactly_as_gguf(type_name: str, rows: int) -> None:
    # Row m = e_k picks out column k of W^T exactly (every other term adds an exact zero), so
    # the product shows the kernel's dequantized weights themselves.
    k = 2 * block_k(type_name)
    weight = random_weight(type_name, 19, k, seed=7)
    w = packed([weight])
    eye = torch.eye(k)
    got = torch.cat([w(eye[i : i + rows]) for i in range(0, k, rows)])
    assert torch.equal(got, dequantized(weight).T)


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_row_result_is_bit_identical_whatever_its_batch(type_name: str) -> None:
    k = 2 * block_k(type_name) if block_k(type_name) == 256 else 6 * block_k(type_name)
    w = packed([random_weight(type_name, 45, k, seed=3)])
    gen = torch.Generator().manual_seed(11)
    row = torch.randn(1, k, generator=gen)
    results = []
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for rows in (1, 3, 8, 64, 300):
                batch = torch.randn(rows, k, generator=gen)
                at = int(torch.randint(rows, (1,), generator=gen))
                batch[at] = row[0]
                results.append(w(batch)[at])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert torch.equal(other, results[0])


def test_parts_of_different_types_stack_along_n() -> None:
    k = 512
    parts = [
        random_weight("Q4_K", 40, k, seed=1),
        random_weight("Q6_K", 17, k, seed=2),
        random_weight("Q8_0", 64, k, seed=3),
    ]
    x = torch.randn(9, k)
    bias = torch.randn(121)
    fused = packed(parts)
    y = fused(x, bias)
    separate = torch.cat([packed([p])(x) for p in parts], dim=1) + bias
    assert fused.out_features == 121 and torch.equal(y, separate)
    assert_close_to_float64(y - bias, torch.cat([dequantized(p) for p in parts]), x)


def test_leading_dimensions_are_kept() -> None:
    w = packed([random_weight("Q4_0", 24, 64, seed=5)])
    x = torch.randn(2, 3, 64)
    assert torch.equal(w(x), w(x.reshape(6, 64)).reshape(2, 3, 24))


def test_packed_size_is_close_to_the_gguf_size() -> None:
    for type_name in ALL_TYPES:
        weight = random_weight(type_name, 64, 1024, seed=0)
        ratio = packed([weight]).num_bytes / weight.num_bytes
        assert 1.0 <= ratio <= 1.03, (type_name, ratio)


def test_refuses_other_inputs() -> None:
    w = packed([random_weight("Q8_0", 16, 64, seed=0)])
    with pytest.raises(TypeError, match="float32"):
        w(torch.randn(2, 64).bfloat16())
    with pytest.raises(RuntimeError, match="K=32"):
        w(torch.randn(2, 32))
    with pytest.raises(ValueError, match="IQ2_XS"):
        packed([QuantizedTensor("IQ2_XS", (1, 256), np.zeros((1, 66), np.uint8))])
    with pytest.raises(ValueError, match="share K"):
        packed([random_weight("Q8_0", 16, 64, seed=0), random_weight("Q8_0", 16, 32, seed=0)])


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_avx512_paths_give_the_avx2_bits(type_name: str, module: types.ModuleType) -> None:
    if not module.avx512_enabled():
        pytest.skip("no AVX-512 here")
    k = 2 * block_k(type_name) if block_k(type_name) == 256 else 6 * block_k(type_name)
    w = packed([random_weight(type_name, 45, k, seed=5)])
    # Up to 12 rows stream the packed panels (1, 2 rows: panels side by side); 3+ row groups
    # take the unpacked path, in groups of 4 (13 rows), 5 (19) and 6 (41).
    xs, bias = [torch.randn(m, k) for m in (1, 2, 3, 7, 12, 13, 19, 41)], torch.randn(45)
    try:
        wide = [w(x, bias) for x in xs]
        module.set_avx512(False)
        narrow = [w(x, bias) for x in xs]
    finally:
        module.set_avx512(True)
    assert all(torch.equal(a, b) for a, b in zip(wide, narrow, strict=True))
