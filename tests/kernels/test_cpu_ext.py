"""Building the C++ CPU kernel module: cache key, fallback, and the build lock."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kernels import cpu_ext, cpu_gemm


def _copy_sources(tmp_path: Path) -> Path:
    copy = tmp_path / "csrc"
    shutil.copytree(cpu_ext.SOURCE_DIR, copy)
    return copy


def test_build_key_covers_every_source_and_header(tmp_path) -> None:
    copy = _copy_sources(tmp_path)
    key = cpu_ext.build_key(copy)
    assert key == cpu_ext.build_key(cpu_ext.SOURCE_DIR)
    for path in sorted([*copy.glob("*.cpp"), *copy.glob("*.h")]):
        original = path.read_bytes()
        path.write_bytes(original + b"\n// edited\n")
        assert cpu_ext.build_key(copy) != key, path.name
        path.write_bytes(original)
    (copy / "new_kernel.cpp").write_text("// a new translation unit\n")
    assert cpu_ext.build_key(copy) != key


def test_every_source_is_compiled_into_the_one_module() -> None:
    names = [p.name for p in cpu_ext.sources()]
    assert {"bindings.cpp", "dense_gemm.cpp", "paged_attention.cpp", "rmsnorm.cpp"} <= set(names)
    assert names == sorted(names)


def test_unsupported_cpu_falls_back_to_torch(monkeypatch) -> None:
    monkeypatch.setattr(cpu_ext, "cpu_supports_kernels", lambda: False)
    cpu_ext.load.cache_clear()
    try:
        assert cpu_gemm.pack_for_kernel(torch.randn(4, 4).bfloat16()) is None
    finally:
        cpu_ext.load.cache_clear()


def test_build_waits_for_the_lock_holder_and_reuses_its_library(tmp_path, monkeypatch) -> None:
    """A second builder reuses what the lock holder built, and gives up at its deadline."""
    compiled: list[str] = []
    monkeypatch.setattr(cpu_ext, "_compile_into", lambda final: compiled.append(str(final)))
    final = cpu_ext.library_path(tmp_path)
    final.parent.mkdir(parents=True)
    with cpu_ext._exclusive(final.parent / "build.lock", timeout_s=1.0):
        with pytest.raises(TimeoutError):
            cpu_ext.build(tmp_path, timeout_s=0.3)
        final.write_bytes(b"built by the lock holder")
    assert cpu_ext.build(tmp_path) == final
    assert compiled == []


def test_a_dead_builder_does_not_block_the_next_one(tmp_path) -> None:
    lock = tmp_path / "build.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import fcntl,os;f=open({str(lock)!r},'a');"
         "fcntl.flock(f,fcntl.LOCK_EX);print('locked',flush=True);os._exit(0)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == b"locked"
    holder.wait(timeout=30)
    with cpu_ext._exclusive(lock, timeout_s=5.0):
        pass
