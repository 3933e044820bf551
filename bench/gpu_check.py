"""The GPU check: one command that proves pdserve on a CUDA device and measures it.

    python bench/gpu_check.py --device cuda --out $OUT      # one H200: within 8 minutes
    python bench/gpu_check.py --dry-plan                    # each step's budget; runs nothing
    python bench/gpu_check.py --preflight                   # + the import and environment checks
    python bench/gpu_check.py --device cpu --quick           # the rehearsal CI runs

Steps, in this order (each a function; a failing step is recorded with its traceback, and the
others run; budgets and the 8-minute limit: bench/gpu_plan.py):

1. ``checkpoint``: a random-weight Llama written with pdserve's demo writer (~1.1B: hidden
   2048, 16 layers, head_dim 128, 16 query / 4 KV heads; ``--quick``: the tiny demo shape);
2. ``bandwidth``: a large device-to-device copy, the floor's bandwidth;
3. ``decode_speed``: pdserve decode steps at each batch against weight bytes / bandwidth;
4. ``chunked_prefill``: a long prompt whole and in mixed steps beside 8 decode rows (the
   chunked total against the whole prefill; the longest mixed step against a decode step),
   every step warmed up first and timed as the median of repeats;
5. ``hf_generate``: HF transformers ``generate`` with a static cache at the same batches,
   eager (``disable_compile``: no Inductor compile, no CUDA graphs);
6. ``device_tests``: the ``device``-parametrised kernel, attention, model and runner tests, on
   the device only (``pytest --device-only DEVICE``), junit XML beside the JSON;
7. ``pd_vs_colocated``: PD on one device, two worker processes and a router (bench/gpu_pd.py),
   against one colocated worker: greedy outputs on the same prompts must be equal; serving
   TTFT/TPOT/throughput of both at each concurrency (bench/serving.py);
8. ``readiness``: VRAM KV over NIXL, between two agents of one process and between two processes.

Results go to ``gpu_check.json`` under ``--out`` (default: ``$OUT``, else bench/results/), written
again after every step, so a run stopped at its time limit still leaves what it measured.
The exit status is 0 only when every step passed.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Only what every step needs is imported here: each step imports its own modules, so a module
# missing on the device machine fails that step (recorded, with its traceback), not the run.
from bench.gpu_plan import FULL, QUICK, STEP_ORDER, Sizes, plan_problems, plan_text  # noqa: E402
from pdserve.envs import read_env  # noqa: E402

BENCH_SHAPE = dict(hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=4, head_dim=128,
                   intermediate_size=8192, target_vocab_size=32000,
                   max_corpus_bytes=3_000_000)  # fmt: skip
DEVICE_TEST_PATHS = ("tests/kernels", "tests/attention", "tests/model",
                     "tests/test_model_runner.py")  # fmt: skip
QUICK_TEST_PATHS = ("tests/kernels/test_sampling_sync_free.py", "tests/kernels/test_host_copy.py")
READINESS_TESTS = ("tests/transport/test_vram.py", "tests/transport/test_vram_two_process.py")


@dataclass
class Check:
    """The run's shared state and its JSON report."""

    device: str
    sizes: Sizes
    out_dir: Path
    quick: bool
    model_dir: Path | None = None
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def json_path(self) -> Path:
        return self.out_dir / "gpu_check.json"

    def save(self) -> None:
        self.json_path.write_text(json.dumps(self.report, indent=2, default=str) + "\n")


def step_checkpoint(c: Check) -> dict[str, Any]:
    from pdserve.model.demo import DemoShape, write_demo_model  # noqa: PLC0415

    shape = DemoShape() if c.quick else DemoShape(**BENCH_SHAPE)
    root = Path(tempfile.mkdtemp(prefix="pdserve-gpu-check-"))
    c.model_dir = write_demo_model(root / "model", shape)
    config = json.loads((c.model_dir / "config.json").read_text())
    return {"dir": str(c.model_dir), "shape": vars(shape), "vocab_size": config["vocab_size"]}


class StepFailed(Exception):
    """A step's figures are in, but they show a failure."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__("the step's checks failed")
        self.result = result


def _pytest_step(c: Check, name: str, args: list[str], require_tests: bool) -> dict[str, Any]:
    """Run pytest on ``args`` in a subprocess, killed at the step's budget; its counts from the
    JUnit XML."""
    xml_path = c.out_dir / f"{name}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"--junitxml={xml_path}", *args]  # fmt: skip
    budget = c.sizes.budget(name)
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=budget)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        raise StepFailed({"command": " ".join(cmd[1:]), "timed_out_s": budget,
                          "output_tail": (out or "")[-3000:]}) from None  # fmt: skip
    suite = ET.parse(xml_path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    assert suite is not None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    result = {"command": " ".join(cmd[1:]), "returncode": proc.returncode, **counts,
              "output_tail": proc.stdout[-3000:]}  # fmt: skip
    if proc.returncode != 0 or (require_tests and counts["tests"] == 0):
        raise StepFailed(result)
    return result


def step_device_tests(c: Check) -> dict[str, Any]:
    paths = QUICK_TEST_PATHS if c.quick else DEVICE_TEST_PATHS
    device = torch.device(c.device).type  # the fixture's names: "cpu", "cuda"
    return _pytest_step(c, "device_tests", ["--device-only", device, *paths], require_tests=True)


def step_readiness(c: Check) -> dict[str, Any]:
    """VRAM KV over NIXL on the device: descriptors and a WRITE that waits for a deliberately
    delayed stream's KV writes between two agents of one process, then pages moved between two
    processes (where UCX takes its cuda_ipc path); they skip without CUDA. The negative case
    (no wait, stale bytes) is not asserted: whether a racing WRITE reads stale bytes depends on
    timing even on a GPU."""
    return _pytest_step(c, "readiness", list(READINESS_TESTS), require_tests=False)


def step_pd_vs_colocated(c: Check) -> dict[str, Any]:
    from bench.gpu_pd import pd_vs_colocated  # noqa: PLC0415

    assert c.model_dir is not None
    result = pd_vs_colocated(c.device, c.sizes, c.model_dir, c.sizes.budget("pd_vs_colocated"))
    if not result["greedy_equal"] or result["errors"]:
        raise StepFailed(result)
    return result


def step_bandwidth(c: Check) -> dict[str, Any]:
    from bench import gpu_speed  # noqa: PLC0415

    result = gpu_speed.copy_bandwidth(c.device, c.sizes.copy_bytes)
    c.report["bandwidth_bytes_per_s"] = result["bytes_per_s"]
    return result


def step_decode_speed(c: Check) -> dict[str, Any]:
    from bench import gpu_speed  # noqa: PLC0415

    assert c.model_dir is not None
    bandwidth = c.report.get("bandwidth_bytes_per_s")
    if bandwidth is None:
        bandwidth = step_bandwidth(c)["bytes_per_s"]
    s = c.sizes
    return gpu_speed.decode_steps(c.model_dir, c.device, list(s.batches), s.context,
                                  s.decode_steps, bandwidth)  # fmt: skip


def step_hf_generate(c: Check) -> dict[str, Any]:
    from bench import gpu_speed  # noqa: PLC0415

    assert c.model_dir is not None
    s = c.sizes
    result = gpu_speed.hf_generate(c.model_dir, c.device, list(s.batches), s.context,
                                   s.decode_steps)  # fmt: skip
    ours = c.report["steps"].get("decode_speed", {}).get("result", {}).get("batches", {})
    for batch, hf in result["batches"].items():
        if batch in ours:
            hf["pdserve_speedup"] = hf["step_ms"] / ours[batch]["step_ms"]
    return result


def step_chunked_prefill(c: Check) -> dict[str, Any]:
    from bench import gpu_speed  # noqa: PLC0415

    assert c.model_dir is not None
    s = c.sizes
    return gpu_speed.chunked_prefill(c.model_dir, c.device, s.long_prompt, s.chunk, 8,
                                     s.decode_steps)  # fmt: skip


STEPS: dict[str, Callable[[Check], dict[str, Any]]] = {
    "checkpoint": step_checkpoint,
    "bandwidth": step_bandwidth,
    "decode_speed": step_decode_speed,
    "chunked_prefill": step_chunked_prefill,
    "hf_generate": step_hf_generate,
    "device_tests": step_device_tests,
    "pd_vs_colocated": step_pd_vs_colocated,
    "readiness": step_readiness,
}
assert tuple(STEPS) == STEP_ORDER


def run_step(c: Check, name: str, fn: Callable[[Check], dict[str, Any]]) -> None:
    print(f"[gpu_check] {name} (budget {c.sizes.budget(name):.0f} s) ...", flush=True)
    t0 = time.perf_counter()
    entry: dict[str, Any]
    try:
        entry = {"status": "ok", "result": fn(c)}
    except StepFailed as e:
        entry = {"status": "failed", "result": e.result}
    except Exception as e:  # noqa: BLE001 - a step's failure is data, the other steps still run
        entry = {"status": "error", "error": repr(e), "traceback": traceback.format_exc()}
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    entry["budget_s"] = c.sizes.budget(name)
    entry["over_budget"] = entry["seconds"] > entry["budget_s"]
    c.report["steps"][name] = entry
    c.save()
    print(f"[gpu_check] {name}: {entry['status']} in {entry['seconds']} s", flush=True)


def _environment(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "device": device, "cuda": torch.version.cuda}  # fmt: skip
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        info |= {"gpu": props.name, "gpu_memory_bytes": props.total_memory}
    return info


def run_check(c: Check, wanted: set[str] | None) -> None:
    """Every wanted step in order; one whose budget no longer fits in the time left is skipped."""
    start = time.monotonic()
    for name, fn in STEPS.items():
        if not (name == "checkpoint" or wanted is None or name in wanted):
            continue
        left = c.sizes.total_limit_s - (time.monotonic() - start)
        if c.sizes.budget(name) > left:
            why = f"its budget {c.sizes.budget(name):.0f} s > {left:.0f} s left"
            c.report["steps"][name] = {"status": "skipped", "error": why}
            continue
        run_step(c, name, fn)
    c.report["total_seconds"] = round(time.monotonic() - start, 2)
    c.report["all_ok"] = all(s["status"] == "ok" for s in c.report["steps"].values())
    c.save()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--quick", action="store_true", help="small sizes: the CPU rehearsal")
    p.add_argument("--out", default=None, help="results folder (default $OUT, else bench/results)")
    p.add_argument("--steps", default=None, help="comma-separated subset of: "
                   + ",".join(STEP_ORDER))  # fmt: skip
    p.add_argument("--dry-plan", action="store_true",
                   help="print the step budgets, check they fit; run nothing")  # fmt: skip
    p.add_argument("--preflight", action="store_true",
                   help="the dry plan, then the import and environment checks (no device "
                   "needed; bench/gpu_preflight.py)")  # fmt: skip
    args = p.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.dry_plan or args.preflight:
        print(plan_text(sizes))
        problems = plan_problems(sizes)
        if args.preflight:
            from bench.gpu_preflight import preflight  # noqa: PLC0415

            problems += preflight([*DEVICE_TEST_PATHS, *READINESS_TESTS])
        for problem in problems:
            print(f"[gpu_check] plan: {problem}")
        return 1 if problems else 0
    out_dir = Path(args.out or read_env().results_dir or REPO / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    # An explicit index: every process (and NIXL's descriptors) then names the same device.
    device = "cuda:0" if args.device == "cuda" else args.device
    c = Check(device, sizes, out_dir, args.quick)
    c.report = {"environment": _environment(device), "quick": args.quick, "steps": {}}
    c.save()
    run_check(c, set(args.steps.split(",")) if args.steps else None)
    print(f"[gpu_check] results: {c.json_path}", flush=True)
    return 0 if c.report["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
