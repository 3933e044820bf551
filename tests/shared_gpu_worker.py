"""One worker process of tests/test_kv_sizing_shared_gpu.py: a ModelRunner taking its CUDA
sizing path on CPU tensors, on a GPU that it shares with other processes.

The GPU's memory is files in ``--gpu-dir``: each process publishes the bytes it holds there
(weights, pool, library workspaces), and ``torch.cuda.mem_get_info`` answers the device-wide
free memory, total less every process's bytes, as the CUDA driver does. The runner code is
the real one; only torch.cuda's memory readings are answered from those files. Prints one JSON
line: the pool's page count, or the error that stopped the runner.

    python -m tests.shared_gpu_worker --checkpoint DIR --gpu-dir DIR --name b [--wait-for a.pool]

Markers it leaves there: ``NAME.started`` (its first memory reading: it holds the sizing lock),
``NAME.weights`` (loaded), ``NAME.pool`` (its sized pool allocated).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

import pdserve.model_runner as model_runner
from pdserve.model_runner import ModelRunner, RunnerConfig

TOTAL = 4 << 30
WEIGHTS = 1 << 30  # what loading the weights counts
ACTIVATION_PEAK = 256 << 20  # the warm-up's peak above its base
LIBRARIES = 128 << 20  # non-torch memory the warm-up brings in (cuBLAS workspaces and such)
UTILIZATION = 0.45
PAGE_SIZE = 4
WAIT_S = 120.0


class SharedGpu:
    """This process's view of the shared device (see the module docstring)."""

    def __init__(self, gpu_dir: Path, name: str) -> None:
        self.dir, self.name = gpu_dir, name
        self.allocated = 0  # torch's allocations (weights, pools)
        self.other = 0  # non-torch memory
        self.num_pools = 0

    def publish(self) -> None:
        tmp = self.dir / f"{self.name}.tmp"
        tmp.write_text(str(self.allocated + self.other))
        os.replace(tmp, self.dir / f"{self.name}.bytes")

    def mark(self, what: str) -> None:
        (self.dir / f"{self.name}.{what}").touch()

    def wait_for(self, marker: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not (self.dir / marker).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{marker} did not appear within {WAIT_S} s")
            time.sleep(0.05)  # poll interval of a bounded wait for another process's file

    def mem_get_info(self, *args: Any) -> tuple[int, int]:
        if not (self.dir / f"{self.name}.started").exists():
            self.mark("started")  # the first reading: the runner holds the sizing lock now
        used = sum(int(p.read_text()) for p in self.dir.glob("*.bytes"))
        return TOTAL - used, TOTAL


def patch_torch_cuda(gpu: SharedGpu, gpu_dir: Path) -> None:
    cuda = torch.cuda
    for name in ("init", "synchronize", "reset_peak_memory_stats", "empty_cache"):
        setattr(cuda, name, lambda *a, **k: None)
    cuda.memory_allocated = lambda *a: gpu.allocated
    cuda.memory_reserved = lambda *a: gpu.allocated
    cuda.max_memory_allocated = lambda *a: gpu.allocated + ACTIVATION_PEAK
    cuda.mem_get_info = gpu.mem_get_info
    uuid = f"fake-{gpu_dir.name}"
    cuda.get_device_properties = lambda *a: types.SimpleNamespace(uuid=uuid)


def patch_runner(gpu: SharedGpu, args: argparse.Namespace) -> None:
    model_runner.is_cpu = lambda device: False  # take the CUDA branches on CPU tensors
    loaded, pool_cls, warm_up = (model_runner.load_model_weights, model_runner.KVPagePool,
                                 ModelRunner._warm_up_largest_step)  # fmt: skip

    def load_model_weights(*a: Any, **k: Any) -> Any:
        gpu.allocated += WEIGHTS
        gpu.publish()
        gpu.mark("weights")
        return loaded(*a, **k)

    def pool(config: Any, device: Any = "cpu", hugepages: bool = True, storage: Any = None) -> Any:
        gpu.allocated += (config.num_pages + 1) * config.page_bytes  # + the scratch page
        gpu.publish()
        gpu.num_pools += 1
        if gpu.num_pools == 2:  # the warm-up pool came first; this is the sized one
            gpu.mark("pool")
        return pool_cls(config, device, hugepages, storage)

    def warm_up_largest_step(self: ModelRunner) -> None:
        gpu.other = LIBRARIES
        gpu.publish()
        if args.wait_for:  # another process's step, before this one's memory is measured
            gpu.wait_for(args.wait_for)
        warm_up(self)

    model_runner.load_model_weights = load_model_weights
    model_runner.KVPagePool = pool
    ModelRunner._warm_up_largest_step = warm_up_largest_step
    if args.no_lock:  # what the runner did before it took turns (the control case)
        model_runner.sizing_lock = lambda device: contextlib.nullcontext()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--gpu-dir", required=True, type=Path)
    p.add_argument("--name", required=True)
    p.add_argument("--wait-for", default=None, help="a marker the warm-up waits for")
    p.add_argument("--no-lock", action="store_true")
    args = p.parse_args()
    gpu = SharedGpu(args.gpu_dir, args.name)
    patch_torch_cuda(gpu, args.gpu_dir)
    patch_runner(gpu, args)
    config = RunnerConfig(args.checkpoint, dtype="float32", page_size=PAGE_SIZE, max_num_seqs=4,
                          max_prefill_tokens=64, gpu_memory_utilization=UTILIZATION,
                          enforce_eager=True)  # fmt: skip
    try:
        runner = ModelRunner(config)
    except ValueError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 0
    sizing = runner.kv_sizing
    assert sizing is not None
    print(json.dumps({"num_pages": sizing.num_pages, "page_bytes": sizing.page_bytes,
                      "other_bytes": sizing.other_bytes}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
