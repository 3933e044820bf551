"""llama.cpp's ``llama-server`` as a reference deployment, run beside pdserve in the same benchmark.

    python bench/llamacpp_ref.py build                    # once: ~15+ min on 2 cores, cached
    python bench/llamacpp_ref.py gguf --hf-dir D --type BF16   # or Q8_0, Q4_K_M, ... (from BF16)

llama.cpp is not a dependency of pdserve. Its source comes from the ``llama-cpp-python`` sdist on
PyPI (``vendor/llama.cpp``), built with CMake at low priority (``nice -n 19``, 2 jobs: the box is
shared) into ``~/.cache/pdserve/bench/llamacpp/<version>/``; a later call finds the build there
(a stamp records the exact configure command) and does nothing. Only ``llama-server`` and
``llama-quantize`` are built. In this tree ``LLAMA_CURL`` is a deprecated no-op (model download
is gone from the build); ``LLAMA_OPENSSL=OFF`` and ``LLAMA_USE_PREBUILT_UI=OFF`` keep the build
off the network, which the box cannot reach beyond the package registry.

The server runs on 127.0.0.1 with issue 21's settings (8 slots, 8192 tokens of context shared
by them, 2 threads) and, like the vLLM reference, without prompt caching: pd_compare sends the
same seeded prompts at each concurrency, and its figures compare computing them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster import ManagedProc, ReferenceServer  # noqa: E402
from pdserve.file_lock import exclusive_file_lock  # noqa: E402
from pdserve.model.pinned import sha256_of  # noqa: E402

VERSION = "0.3.36"  # of llama-cpp-python, whose sdist vendors llama.cpp
# The sdist's SHA-256 per version: a download with another is refused before it is unpacked.
SDIST_SHA256 = {"0.3.36": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"}
TARGETS = ("llama-server", "llama-quantize")
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries, no rpath into the build tree
    # On an AMX CPU, -march=native compiles ggml's AMX matmul, which crashes llama-server here
    # (SIGSEGV in ggml_backend_amx_mul_mat at its warm-up decode, Sapphire Rapids VM, 0.3.36);
    # without it llama.cpp keeps AVX-512/VNNI and its repacked kernels. Explicit -mno-* flags
    # win over -march=native's whatever their order.
    f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}",
)  # fmt: skip
NICE = ("nice", "-n", "19")
BUILD_JOBS = 2
BUILD_TIMEOUT_S = 3 * 3600.0  # a loaded 2-core box; 15 min when it is quiet
CONVERT_TIMEOUT_S = 1800.0
READY_TIMEOUT_S = 300.0  # loading a small GGUF takes seconds; a large one on a busy box, more

Runner = Callable[[Sequence[str], Path], None]


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "pdserve" / "bench" / "llamacpp"


def run_command(argv: Sequence[str], cwd: Path) -> None:
    subprocess.run(list(argv), cwd=cwd, check=True, timeout=BUILD_TIMEOUT_S)


@dataclass(frozen=True)
class LlamaCppTree:
    """The source and build of one llama.cpp version under the cache."""

    root: Path  # <cache>/<version>
    jobs: int = BUILD_JOBS

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def build_dir(self) -> Path:
        return self.root / "build"

    @property
    def server(self) -> Path:
        return self.build_dir / "bin" / "llama-server"

    @property
    def quantize(self) -> Path:
        return self.build_dir / "bin" / "llama-quantize"

    @property
    def convert_script(self) -> Path:
        return self.src / "convert_hf_to_gguf.py"

    @property
    def stamp(self) -> Path:
        return self.root / "build.json"

    def commands(self) -> list[list[str]]:
        """Configure, then build the two targets, both at the lowest priority."""
        return [
            [*NICE, "cmake", "-S", str(self.src), "-B", str(self.build_dir), *CMAKE_OPTIONS],
            [*NICE, "cmake", "--build", str(self.build_dir), "-j", str(self.jobs),
             "--target", *TARGETS],
        ]  # fmt: skip

    def is_built(self) -> bool:
        """The binaries exist and were made by exactly today's commands."""
        if not (self.server.is_file() and self.quantize.is_file() and self.stamp.is_file()):
            return False
        try:
            return json.loads(self.stamp.read_text()) == {"commands": self.commands()}
        except json.JSONDecodeError:
            return False


def download_source(version: str, dest: Path) -> None:
    """``vendor/llama.cpp`` of the llama-cpp-python sdist, extracted to ``dest`` (absent before)."""
    with tempfile.TemporaryDirectory(prefix="llamacpp-sdist-", dir=dest.parent) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={version}", "-d", tmp],
            check=True, timeout=CONVERT_TIMEOUT_S, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        check_pinned(sdist, version)
        extract_source(sdist, version, Path(tmp) / "src")
        os.replace(Path(tmp) / "src", dest)


def check_pinned(sdist: Path, version: str) -> None:
    """Refuse (RuntimeError naming the file) an sdist whose SHA-256 is not the pinned one."""
    pinned = SDIST_SHA256.get(version)
    if pinned is None:
        raise RuntimeError(f"llama-cpp-python {version} has no pinned SHA-256 (SDIST_SHA256)")
    actual = sha256_of(sdist)
    if actual != pinned:
        raise RuntimeError(
            f"{sdist.name}: refused, SHA-256 mismatch: got {actual}, pinned {pinned}"
        )


def extract_source(sdist: Path, version: str, dest: Path) -> None:
    """The sdist's ``vendor/llama.cpp`` as ``dest`` (nothing else of the sdist)."""
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise RuntimeError(f"{sdist} has no {prefix}")
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(dest, members=members, filter="data")


def ensure_build(
    version: str = VERSION,
    cache_dir: Path | None = None,
    run: Runner | None = None,
    fetch: Callable[[str, Path], None] | None = None,
) -> LlamaCppTree:
    """The built tree, fetching and building it on first use; a cached build is reused."""
    run, fetch = run or run_command, fetch or download_source
    tree = LlamaCppTree((cache_dir or default_cache_dir()) / version)
    if tree.is_built():
        return tree
    tree.root.mkdir(parents=True, exist_ok=True)
    with exclusive_file_lock(tree.root / "build.lock", BUILD_TIMEOUT_S):
        if tree.is_built():  # another process built it while this one waited
            return tree
        if not (tree.src / "CMakeLists.txt").is_file():
            shutil.rmtree(tree.src, ignore_errors=True)
            fetch(version, tree.src)
        tree.stamp.unlink(missing_ok=True)
        for argv in tree.commands():
            run(argv, tree.root)
        tree.stamp.write_text(json.dumps({"commands": tree.commands()}))
    return tree


# What llama-quantize makes from the BF16 file (types GGUF users download most; Q4_K_M mixes
# Q4_K and Q6_K, with llama.cpp's fallbacks for rows not a multiple of 256 wide).
QUANTIZE_TYPES = ("Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
FILE_TYPES = ("BF16", *QUANTIZE_TYPES)


def gguf_path_for(hf_dir: Path, file_type: str) -> Path:
    """Where a conversion of ``hf_dir`` to ``file_type`` (one of FILE_TYPES) is cached: beside
    it."""
    return hf_dir.parent / f"{hf_dir.name}.{file_type}.gguf"


def write_gguf(tree: LlamaCppTree, hf_dir: Path, file_type: str, run: Runner | None = None) -> Path:
    """A BF16 GGUF of ``hf_dir`` by llama.cpp's converter, or one of QUANTIZE_TYPES quantized
    from that BF16 file by ``llama-quantize``; each written once."""
    run = run or run_command
    out = gguf_path_for(hf_dir, file_type)
    if out.exists():
        return out
    part = out.with_name(out.name + ".part")
    if file_type == "BF16":
        run([*NICE, sys.executable, str(tree.convert_script), str(hf_dir), "--outtype", "bf16",
             "--outfile", str(part)], tree.src)  # fmt: skip
    elif file_type in QUANTIZE_TYPES:
        bf16 = write_gguf(tree, hf_dir, "BF16", run)
        run([*NICE, str(tree.quantize), str(bf16), str(part), file_type], tree.root)
    else:
        raise ValueError(f"unsupported GGUF file type {file_type!r}; choose one of {FILE_TYPES}")
    os.replace(part, out)
    return out


def gguf_label(path: Path) -> str:
    """A short name for a GGUF in reports: its weight type where the file name ends with one
    (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``Q4_1``), else its stem."""
    stem = path.name.removesuffix(".gguf")
    return stem.rsplit(".", 1)[-1] if "." in stem else stem


@dataclass
class LlamaServer(ReferenceServer):
    """A ``llama-server`` child process; ``async with`` starts it and waits for its /health."""

    ready_timeout_s: ClassVar[float] = READY_TIMEOUT_S

    server: Path  # the llama-server binary
    gguf: Path
    port: int
    served_model_name: str = "bench"
    num_slots: int = 8  # -np: requests decoded together
    context_len: int = 8192  # -c: shared by the slots (1024 tokens each)
    num_threads: int = 2
    prompt_caching: bool = False
    # Speculation (issue 29's anchor): --spec-type draft-simple with a draft, or ngram-simple.
    spec_type: str | None = None
    model_draft: Path | None = None
    draft_max: int | None = None
    jinja: bool = False  # --jinja: the model's own chat template, which tool calls need
    log_path: Path = field(
        default_factory=lambda: Path(tempfile.mkdtemp(prefix="pdserve-llamacpp-")) / "server.log"
    )

    def __post_init__(self) -> None:
        # The same child-process handling as bench/cluster.py's pdserve processes (own session,
        # a stop takes the group; readiness polled with a deadline, failing fast on exit).
        self.proc = ManagedProc(
            "llama-server", "llamacpp", self.argv(), self.url, self.log_path,
            command=(str(self.server),), ready_path="/health",  # 503 while the model loads
        )  # fmt: skip

    def argv(self) -> list[str]:
        argv = [
            "-m", str(self.gguf), "-np", str(self.num_slots), "-c", str(self.context_len),
            "-t", str(self.num_threads), "--host", "127.0.0.1", "--port", str(self.port),
            "--alias", self.served_model_name, "--no-webui",
        ]  # fmt: skip
        if self.spec_type:
            argv += ["--spec-type", self.spec_type]
        if self.model_draft is not None:
            argv += ["--model-draft", str(self.model_draft)]
        if self.draft_max is not None:
            argv += ["--spec-draft-n-max", str(self.draft_max)]
        argv += ["--jinja"] if self.jinja else []
        # Off: neither the slot's own prompt reuse nor the host-memory prompt cache.
        return argv + ([] if self.prompt_caching else ["--no-cache-prompt", "--cache-ram", "0"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("action", choices=["build", "gguf"])
    p.add_argument("--hf-dir", default=None, help="gguf: the HF checkpoint to convert")
    p.add_argument("--type", default="BF16", choices=FILE_TYPES, help="gguf: its weights")
    args = p.parse_args(argv)
    tree = ensure_build()
    if args.action == "build":
        print(tree.server)
        print(tree.quantize)
    else:
        if not args.hf_dir:
            p.error("gguf needs --hf-dir")
        print(write_gguf(tree, Path(args.hf_dir), args.type))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
