"""Two workers sizing their KV pools on one GPU (``pdserve up --device cuda`` starts prefill and
decode at once): each gets its share, whichever finishes its warm-up second.

The GPU is simulated across two real processes (tests/shared_gpu_worker.py): device-wide free
memory, as ``cudaMemGetInfo`` reports it, is total less what both processes hold. The sizing
subtracts a device-wide difference as this worker's non-torch overhead, so without turns the
second worker counts the first one's pool as its own (issue 22, vLLM issue 55827).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.model.checkpoints import write_checkpoint
from tests.shared_gpu_worker import (
    ACTIVATION_PEAK,
    LIBRARIES,
    TOTAL,
    UTILIZATION,
    WEIGHTS,
)

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _start(checkpoint: Path, gpu_dir: Path, name: str, *flags: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tests.shared_gpu_worker", "--checkpoint", str(checkpoint),
           "--gpu-dir", str(gpu_dir), "--name", name, *flags]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def _wait_for_file(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)  # poll interval of a bounded wait for another process


def _result(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _run_pair(checkpoint: Path, gpu_dir: Path, first: list[str], second: list[str]) -> tuple:
    """Start ``a``; once it is sizing (its first memory reading), start ``b``."""
    a = _start(checkpoint, gpu_dir, "a", *first)
    try:
        _wait_for_file(gpu_dir / "a.started", a)
        b = _start(checkpoint, gpu_dir, "b", *second)
        try:
            return _result(a), _result(b)
        finally:
            b.kill()
    finally:
        a.kill()


def test_the_worker_that_sizes_second_gets_its_full_share(checkpoint: Path, tmp_path: Path):
    # b's warm-up ends after a's pool exists: the order that starved the second worker.
    a, b = _run_pair(checkpoint, tmp_path, [], ["--wait-for", "a.pool"])
    share = int(TOTAL * UTILIZATION)
    want = (share - WEIGHTS - ACTIVATION_PEAK - LIBRARIES) // a["page_bytes"]
    assert a["num_pages"] == want
    assert b["num_pages"] == want and b["other_bytes"] == LIBRARIES


def test_without_turns_a_worker_counts_the_others_memory_as_its_own(
    checkpoint: Path, tmp_path: Path
) -> None:
    """The control, with the lock off: ``a`` measures its warm-up once ``b`` has loaded its
    weights, and counts them as its own overhead."""
    a, b = _run_pair(checkpoint, tmp_path, ["--no-lock", "--wait-for", "b.weights"],
                     ["--no-lock"])  # fmt: skip
    assert "no room for the KV cache" in a.get("error", ""), a
    assert "num_pages" in b
