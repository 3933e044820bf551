"""The GPU check: one command that proves pdserve on a CUDA device and measures it.

    python bench/gpu_check.py --device cuda --out $OUT      # one H200: about 6-8 minutes
    python bench/gpu_check.py --device cpu --quick           # the rehearsal CI runs (~1-2 min)

Steps (each a function; a failing step is recorded with its traceback, and the others run):

1. ``checkpoint``: a random-weight Llama written with pdserve's demo writer (~1.1B: hidden
   2048, 16 layers, head_dim 128, 16 query / 4 KV heads; ``--quick``: the tiny demo shape);
2. ``device_tests``: the ``device``-parametrised kernel, model and runner tests, on the device
   only (``pytest --device-only DEVICE``), junit XML beside the JSON;
3. ``pd_vs_colocated``: PD on one device, two worker processes and a router (bench/cluster.py),
   against one colocated worker: greedy outputs on the same prompts must be equal; serving
   TTFT/TPOT/throughput of both at each concurrency (bench/serving.py);
4. ``bandwidth``: a large device-to-device copy, the floor's bandwidth;
5. ``decode_speed``: pdserve decode steps at each batch against weight bytes / bandwidth;
6. ``hf_generate``: HF transformers ``generate`` with a static cache at the same batches;
7. ``chunked_prefill``: a long prompt whole and in mixed steps beside 8 decode rows (the chunked
   total against the whole prefill; the longest mixed step against a decode step).

Results go to ``gpu_check.json`` under ``--out`` (default: ``$OUT``, else bench/results/), written
again after every step, so a run stopped at its time limit still leaves what it measured.
The exit status is 0 only when every step passed.
"""

from __future__ import annotations

import argparse
import asyncio
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

import aiohttp
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import gpu_speed  # noqa: E402
from bench.cluster import Cluster, ClusterSpec, ManagedProc, free_port  # noqa: E402
from bench.serving import BenchConfig, run_benchmark  # noqa: E402
from pdserve.envs import read_env  # noqa: E402
from pdserve.model.demo import DemoShape, write_demo_model  # noqa: E402

BENCH_SHAPE = DemoShape(hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=4,
                        head_dim=128, intermediate_size=8192, target_vocab_size=32000,
                        max_corpus_bytes=3_000_000)  # fmt: skip
DEVICE_TEST_PATHS = ("tests/kernels", "tests/model", "tests/test_model_runner.py")
QUICK_TEST_PATHS = ("tests/kernels/test_sampling_sync_free.py", "tests/kernels/test_host_copy.py")
PROMPTS = ("The quick brown fox", "def fibonacci(n):", "import torch\nx =", "Once upon a time",
           "1, 2, 3, 4,", "SELECT * FROM", "class Engine:", "while True:")  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    """How much each step does: the full run, or ``--quick``'s rehearsal."""

    batches: tuple[int, ...]
    concurrencies: tuple[int, ...]
    context: int
    decode_steps: int
    greedy_tokens: int
    serving_input: int
    serving_output: int
    copy_bytes: int
    test_timeout_s: float
    long_prompt: int  # chunked_prefill: the prompt, in chunks of `chunk` beside 8 decode rows
    chunk: int
    budget_s: float  # no step starts after this many seconds (the device call's limit is 600)


FULL = Sizes((1, 8, 64), (1, 16, 64), 128, 20, 32, 128, 128, 2 << 30, 240.0, 4096, 512, 420.0)
QUICK = Sizes((1, 4), (1, 4), 32, 4, 8, 32, 8, 32 << 20, 240.0, 256, 64, 600.0)


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
    shape = DemoShape() if c.quick else BENCH_SHAPE
    root = Path(tempfile.mkdtemp(prefix="pdserve-gpu-check-"))
    c.model_dir = write_demo_model(root / "model", shape)
    config = json.loads((c.model_dir / "config.json").read_text())
    return {"dir": str(c.model_dir), "shape": vars(shape), "vocab_size": config["vocab_size"]}


def _pytest_step(c: Check, name: str, args: list[str], require_tests: bool) -> dict[str, Any]:
    """Run pytest on ``args`` in a subprocess; its counts from the JUnit XML."""
    xml_path = c.out_dir / f"{name}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"--junitxml={xml_path}", *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          timeout=c.sizes.test_timeout_s)  # fmt: skip
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
    """VRAM KV over NIXL between two agents on the device: descriptors, and a WRITE that waits
    for a deliberately delayed stream's KV writes (tests/transport/test_vram.py; they skip
    without CUDA). The negative case (no wait, stale bytes) is not asserted: whether a racing
    WRITE reads stale bytes depends on timing even on a GPU."""
    return _pytest_step(c, "readiness", ["tests/transport/test_vram.py"], require_tests=False)


class StepFailed(Exception):
    """A step's figures are in, but they show a failure."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__("the step's checks failed")
        self.result = result


def _worker_args(c: Check, utilization: float) -> tuple[str, ...]:
    args = ("--device", c.device, "--heartbeat-interval", "0.5", "--max-num-seqs",
            str(max(c.sizes.concurrencies)))  # fmt: skip
    if torch.device(c.device).type == "cpu":
        return (*args, "--kv-cache-mb", "64", "--num-threads", "1")
    return (*args, "--gpu-memory-utilization", str(utilization))


async def _greedy(session: aiohttp.ClientSession, url: str, c: Check) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {"model": "bench", "prompt": prompt, "max_tokens": c.sizes.greedy_tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        timeout = aiohttp.ClientTimeout(total=120)
        async with session.post(f"{url}/v1/completions", json=body, timeout=timeout) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{url}: HTTP {resp.status}: {data}")
            texts.append(data["choices"][0]["text"])
    return texts


async def _serve_figures(url: str, c: Check) -> dict[str, Any]:
    out = {}
    for conc in c.sizes.concurrencies:
        cfg = BenchConfig(base_url=url, model="bench", endpoint="completions",
                          input_len=c.sizes.serving_input, output_len=c.sizes.serving_output,
                          num_requests=max(2 * conc, 4), concurrency=conc,
                          tokenizer=str(c.model_dir), is_progress_shown=False,
                          max_duration_s=120)  # fmt: skip
        s = await run_benchmark(cfg)
        out[str(conc)] = {"output_tok_s": s["output_throughput"], "ttft_ms": s["ttft_ms"],
                          "tpot_ms": s["tpot_ms"], "errors": s["num_errors"]}  # fmt: skip
    return out


async def _pd(c: Check) -> tuple[list[str], dict[str, Any]]:
    spec = ClusterSpec(model_dir=str(c.model_dir), served_model_name="bench",
                       worker_args=_worker_args(c, 0.3), router_args=())  # fmt: skip
    async with Cluster(spec) as cluster:
        greedy = await _greedy(cluster.session, cluster.router.url, c)
        return greedy, await _serve_figures(cluster.router.url, c)


async def _colocated(c: Check) -> tuple[list[str], dict[str, Any]]:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="pdserve-gpu-check-")) / "colocated.log"
    proc = ManagedProc("colocated", "colocated",
                       ["serve", "--role", "colocated", "--model", str(c.model_dir), "--port",
                        str(port), "--served-model-name", "bench", *_worker_args(c, 0.6)],
                       f"http://127.0.0.1:{port}", log)  # fmt: skip
    async with aiohttp.ClientSession() as session:
        proc.start()
        try:
            await proc.wait_ready(session, 300)
            return await _greedy(session, proc.url, c), await _serve_figures(proc.url, c)
        finally:
            await asyncio.to_thread(proc.stop)


def step_pd_vs_colocated(c: Check) -> dict[str, Any]:
    pd_text, pd_serving = asyncio.run(_pd(c))
    co_text, co_serving = asyncio.run(_colocated(c))
    mismatched = [i for i, (a, b) in enumerate(zip(pd_text, co_text, strict=True)) if a != b]
    ratios = {k: pd_serving[k]["output_tok_s"] / max(co_serving[k]["output_tok_s"], 1e-9)
              for k in pd_serving}  # fmt: skip
    result = {"greedy_equal": not mismatched, "mismatched_prompts": mismatched,
              "pd_serving": pd_serving, "colocated_serving": co_serving,
              "pd_over_colocated_throughput": ratios}  # fmt: skip
    errors = sum(v["errors"] for v in (*pd_serving.values(), *co_serving.values()))
    if mismatched or errors:
        raise StepFailed(result)
    return result


def step_bandwidth(c: Check) -> dict[str, Any]:
    result = gpu_speed.copy_bandwidth(c.device, c.sizes.copy_bytes)
    c.report["bandwidth_bytes_per_s"] = result["bytes_per_s"]
    return result


def step_decode_speed(c: Check) -> dict[str, Any]:
    assert c.model_dir is not None
    bandwidth = c.report.get("bandwidth_bytes_per_s")
    if bandwidth is None:
        bandwidth = step_bandwidth(c)["bytes_per_s"]
    s = c.sizes
    return gpu_speed.decode_steps(c.model_dir, c.device, list(s.batches), s.context,
                                  s.decode_steps, bandwidth)  # fmt: skip


def step_hf_generate(c: Check) -> dict[str, Any]:
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
    assert c.model_dir is not None
    s = c.sizes
    return gpu_speed.chunked_prefill(c.model_dir, c.device, s.long_prompt, s.chunk, 8,
                                     s.decode_steps)  # fmt: skip


STEPS: list[tuple[str, Callable[[Check], dict[str, Any]]]] = [
    ("checkpoint", step_checkpoint),
    ("device_tests", step_device_tests),
    ("pd_vs_colocated", step_pd_vs_colocated),
    ("readiness", step_readiness),
    ("bandwidth", step_bandwidth),
    ("decode_speed", step_decode_speed),
    ("hf_generate", step_hf_generate),
    ("chunked_prefill", step_chunked_prefill),
]


def run_step(c: Check, name: str, fn: Callable[[Check], dict[str, Any]]) -> None:
    print(f"[gpu_check] {name} ...", flush=True)
    t0 = time.perf_counter()
    entry: dict[str, Any]
    try:
        entry = {"status": "ok", "result": fn(c)}
    except StepFailed as e:
        entry = {"status": "failed", "result": e.result}
    except Exception as e:  # noqa: BLE001 - a step's failure is data, the other steps still run
        entry = {"status": "error", "error": repr(e), "traceback": traceback.format_exc()}
    entry["seconds"] = round(time.perf_counter() - t0, 2)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--quick", action="store_true", help="small sizes: the CPU rehearsal")
    p.add_argument("--out", default=None, help="results folder (default $OUT, else bench/results)")
    p.add_argument("--steps", default=None, help="comma-separated subset of: "
                   + ",".join(n for n, _ in STEPS))  # fmt: skip
    args = p.parse_args(argv)
    out_dir = Path(args.out or read_env().results_dir or REPO / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    # An explicit index: every process (and NIXL's descriptors) then names the same device.
    device = "cuda:0" if args.device == "cuda" else args.device
    c = Check(device, QUICK if args.quick else FULL, out_dir, args.quick)
    c.report = {"environment": _environment(device), "quick": args.quick, "steps": {}}
    wanted = set(args.steps.split(",")) if args.steps else None
    start = time.monotonic()
    for name, fn in STEPS:
        if not (name == "checkpoint" or wanted is None or name in wanted):
            continue
        if time.monotonic() - start > c.sizes.budget_s:
            c.report["steps"][name] = {"status": "skipped", "error": "time budget spent"}
            continue
        run_step(c, name, fn)
    c.report["all_ok"] = all(s["status"] == "ok" for s in c.report["steps"].values())
    c.save()
    print(f"[gpu_check] results: {c.json_path}", flush=True)
    return 0 if c.report["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
