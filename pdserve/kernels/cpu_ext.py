"""The AVX2 C++ CPU kernels (every ``csrc/*.cpp``, one Python module), built on first use.

The sources are compiled once per machine with torch's extension builder and cached under
``~/.cache/pdserve/kernels/<hash of sources, headers, flags, torch>/``. Processes that start
together (a cluster's workers) take turns on an ``flock`` (the kernel drops it if its holder
dies, so a killed builder never blocks the others) and the first one builds; the library is
compiled in a private folder and renamed into place, so a reader never sees a half-written file.
``make install`` builds it ahead of time (``python -m pdserve.kernels.cpu_gemm``), so servers
only load it. Where it cannot be built (no compiler) or the CPU has no AVX2, :func:`load`
returns None and every caller falls back to torch.

What the module holds: the bf16-weight matmul (:mod:`pdserve.kernels.cpu_gemm`), paged decode
attention (:mod:`pdserve.kernels.paged_attention`), fused RMSNorm (:mod:`pdserve.kernels.rmsnorm`)
and grammar masks on logits (:mod:`pdserve.kernels.logits_processors`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch

from pdserve import envs
from pdserve.file_lock import exclusive_file_lock as _exclusive

logger = logging.getLogger(__name__)

MODULE_NAME = "pdserve_cpu_ext"
SOURCE_DIR = Path(__file__).parent / "csrc"
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-fopenmp")
LDFLAGS = ("-fopenmp",)
BUILD_TIMEOUT_S = 900.0  # a few translation units of ~1 min each on 2 busy cores


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "pdserve" / "kernels"


def cpu_supports_kernels() -> bool:
    """AVX2 + FMA is what the kernels need; torch reports AVX2 or better."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def sources(source_dir: Path | None = None) -> list[Path]:
    """The translation units compiled into the module, in a stable order."""
    return sorted((source_dir or SOURCE_DIR).glob("*.cpp"))


def build_key(source_dir: Path | None = None) -> str:
    """Changes whenever a source or header, the flags, torch or Python change (then a new
    build is made)."""
    root = source_dir or SOURCE_DIR
    digest = hashlib.sha256()
    for path in sorted([*root.glob("*.cpp"), *root.glob("*.h")]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    for part in (*CFLAGS, *LDFLAGS, torch.__version__, sys.version):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def library_path(cache_dir: Path) -> Path:
    return cache_dir / build_key() / f"{MODULE_NAME}.so"


def build(cache_dir: Path, timeout_s: float = BUILD_TIMEOUT_S) -> Path:
    """Compile (unless another process just did) and rename the library into place."""
    final = library_path(cache_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(final.parent / "build.lock", timeout_s):
        if not final.exists():
            _compile_into(final)
    return final


def compile_in(build_dir: Path) -> Path:
    """Compile every source in ``build_dir`` (ninja keeps object files there, so a kept
    folder rebuilds only what changed: handy while editing a kernel); the library's path."""
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    load(
        MODULE_NAME, [str(p) for p in sources()], extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS), build_directory=str(build_dir), is_python_module=False,
        verbose=False,
    )  # fmt: skip
    return build_dir / f"{MODULE_NAME}.so"


def _compile_into(final: Path) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="build-", dir=final.parent))
    try:
        os.replace(compile_in(scratch), final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _put_ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; pip's ``ninja`` package puts it beside the venv's python."""
    if shutil.which("ninja") is None:
        envs.prepend_to_path(str(Path(sys.executable).parent))


def import_library(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def load(cache_dir: Path | None = None) -> types.ModuleType | None:
    """The compiled module, building it if needed; None where it cannot run here."""
    if not cpu_supports_kernels():
        return None
    cache_dir = cache_dir or default_cache_dir()
    path = library_path(cache_dir)
    try:
        if not path.exists():
            logger.info("building the C++ CPU kernels into %s (once per machine)", path)
            build(cache_dir)
        return import_library(path)
    except Exception as exc:  # no compiler, broken toolchain: the torch paths still work
        logger.warning("C++ CPU kernels unavailable, using torch's operators: %s", exc)
        return None
