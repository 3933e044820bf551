"""The bf16 CPU kernel equals a float32 product of the same bf16 weights, for any shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_gemm

module = cpu_gemm.load()
pytestmark = pytest.mark.skipif(module is None, reason="kernel needs AVX2 and a C++ compiler")


def _packed(w: torch.Tensor) -> cpu_gemm.PackedBF16Weight:
    assert module is not None
    return cpu_gemm.PackedBF16Weight(module, w)


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


def test_build_key_follows_the_source(tmp_path, monkeypatch) -> None:
    key = cpu_gemm.build_key()
    changed = tmp_path / "bf16_gemm.cpp"
    changed.write_text(cpu_gemm.SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(cpu_gemm, "SOURCE", changed)
    assert cpu_gemm.build_key() != key


def test_unsupported_cpu_falls_back_to_torch(monkeypatch) -> None:
    monkeypatch.setattr(cpu_gemm, "cpu_supports_kernel", lambda: False)
    cpu_gemm.load.cache_clear()
    try:
        assert cpu_gemm.pack_for_kernel(torch.randn(4, 4).bfloat16()) is None
    finally:
        cpu_gemm.load.cache_clear()


def test_build_waits_for_the_lock_holder_and_reuses_its_library(tmp_path, monkeypatch) -> None:
    """A second builder reuses what the lock holder built, and gives up at its deadline."""
    compiled: list[str] = []
    monkeypatch.setattr(cpu_gemm, "_compile_into", lambda final: compiled.append(str(final)))
    final = cpu_gemm.library_path(tmp_path)
    final.parent.mkdir(parents=True)
    with cpu_gemm._exclusive(final.parent / "build.lock", timeout_s=1.0):
        with pytest.raises(TimeoutError):
            cpu_gemm.build(tmp_path, timeout_s=0.3)
        final.write_bytes(b"built by the lock holder")
    assert cpu_gemm.build(tmp_path) == final
    assert compiled == []


def test_a_dead_builder_does_not_block_the_next_one(tmp_path) -> None:
    import subprocess
    import sys

    lock = tmp_path / "build.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import fcntl,os;f=open({str(lock)!r},'a');"
         "fcntl.flock(f,fcntl.LOCK_EX);print('locked',flush=True);os._exit(0)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == b"locked"
    holder.wait(timeout=30)
    with cpu_gemm._exclusive(lock, timeout_s=5.0):
        pass
