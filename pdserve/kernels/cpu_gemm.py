"""The AVX2 bf16-weight matmul for decode-sized inputs (csrc/bf16_gemm.cpp), built on first use.

The C++ source is compiled once per machine with torch's extension builder and cached under
``~/.cache/pdserve/kernels/<hash of source, flags, torch>/``. Processes that start together
(a cluster's workers) take turns on an ``flock`` (the kernel drops it if its holder dies, so a
killed builder never blocks the others) and the first one builds; the library is compiled in a
private folder and renamed into place, so a reader never sees a half-written file.
``make install`` builds it ahead of time (``python -m pdserve.kernels.cpu_gemm``), so servers
only load it. Where it cannot be built (no compiler) or the CPU has no AVX2, callers fall back
to torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

MODULE_NAME = "pdserve_bf16_gemm"
SOURCE = Path(__file__).parent / "csrc" / "bf16_gemm.cpp"
CFLAGS = ("-O3", "-mavx2", "-mfma", "-std=c++17", "-fopenmp")
LDFLAGS = ("-fopenmp",)
BUILD_TIMEOUT_S = 600.0  # one compile takes ~1 min on 2 busy cores


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "pdserve" / "kernels"


def cpu_supports_kernel() -> bool:
    """AVX2 + FMA is what the kernel needs; torch reports AVX2 or better."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def build_key() -> str:
    """Changes whenever the source, flags, torch or Python change (then a new build is made)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (*CFLAGS, *LDFLAGS, torch.__version__, sys.version):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def library_path(cache_dir: Path) -> Path:
    return cache_dir / build_key() / f"{MODULE_NAME}.so"


@contextlib.contextmanager
def _exclusive(lock_path: Path, timeout_s: float) -> Iterator[None]:
    """An flock on ``lock_path``, polled until ``timeout_s`` (then TimeoutError)."""
    deadline = time.monotonic() + timeout_s
    with open(lock_path, "a") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{lock_path} held for {timeout_s} s") from None
                time.sleep(0.2)  # poll interval of a bounded wait, not synchronisation by sleep
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(cache_dir: Path, timeout_s: float = BUILD_TIMEOUT_S) -> Path:
    """Compile (unless another process just did) and rename the library into place."""
    final = library_path(cache_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(final.parent / "build.lock", timeout_s):
        if not final.exists():
            _compile_into(final)
    return final


def _compile_into(final: Path) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="build-", dir=final.parent))
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()

        load(
            MODULE_NAME, [str(SOURCE)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
            build_directory=str(scratch), is_python_module=False, verbose=False,
        )  # fmt: skip
        os.replace(scratch / f"{MODULE_NAME}.so", final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _put_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; pip's ``ninja`` package puts it beside the venv's python."""
    if shutil.which("ninja") is None:
        os.environ["PATH"] = (
            f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        )


def _import(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load(cache_dir: Path | None = None) -> types.ModuleType | None:
    """The compiled module, building it if needed; None where it cannot run here."""
    if not cpu_supports_kernel():
        return None
    cache_dir = cache_dir or default_cache_dir()
    path = library_path(cache_dir)
    try:
        if not path.exists():
            logger.info("building the bf16 CPU matmul kernel into %s (once per machine)", path)
            build(cache_dir)
        return _import(path)
    except Exception as exc:  # no compiler, broken toolchain: torch's matmul still works
        logger.warning("bf16 CPU matmul kernel unavailable, using torch's matmul: %s", exc)
        return None


class PackedBF16Weight:
    """A ``(N, K)`` bf16 weight packed for the kernel; call it on ``(M, K)`` rows."""

    def __init__(self, module: types.ModuleType, weight: torch.Tensor) -> None:
        self._module = module
        self.out_features = weight.shape[0]
        self.packed = module.pack(weight.contiguous())

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = self._module.linear(rows, self.packed, self.out_features, bias, out_dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    @property
    def num_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


def pack_for_kernel(weight: torch.Tensor) -> PackedBF16Weight | None:
    """Packs a CPU bf16 weight when the kernel runs here, else None (use torch)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    module = load()
    return PackedBF16Weight(module, weight) if module is not None else None


if __name__ == "__main__":  # `python -m pdserve.kernels.cpu_gemm`: build ahead of time
    logging.basicConfig(level=logging.INFO)
    where = library_path(default_cache_dir())
    print(f"bf16 CPU matmul kernel: {'ready at ' + str(where) if load() else 'unavailable'}")
