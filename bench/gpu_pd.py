"""The GPU check's PD step: PD on one device (prefill, decode and router processes) against
one colocated worker: equal greedy outputs, and serving figures of both at each concurrency.

Both deployments must fit one budget: each half gets its share as a deadline, so a cluster
that never comes up fails the step instead of eating the check's remaining time.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import torch

from bench.cluster import Cluster, ClusterSpec, ManagedProc, free_port
from bench.serving import BenchConfig, run_benchmark

PROMPTS = ("The quick brown fox", "def fibonacci(n):", "import torch\nx =", "Once upon a time",
           "1, 2, 3, 4,", "SELECT * FROM", "class Engine:", "while True:")  # fmt: skip
PD_SHARE = 0.6  # of the budget: three processes start, against one for the colocated half


def worker_args(device: str, max_num_seqs: int, utilization: float) -> tuple[str, ...]:
    args = ("--device", device, "--heartbeat-interval", "0.5", "--max-num-seqs",
            str(max_num_seqs))  # fmt: skip
    if torch.device(device).type == "cpu":
        return (*args, "--kv-cache-mb", "64", "--num-threads", "1")
    return (*args, "--gpu-memory-utilization", str(utilization))


async def _greedy(
    session: aiohttp.ClientSession, url: str, max_tokens: int, timeout_s: float
) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(f"{url}/v1/completions", json=body, timeout=timeout) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{url}: HTTP {resp.status}: {data}")
            texts.append(data["choices"][0]["text"])
    return texts


async def _serve_figures(url: str, sizes: Any, model_dir: Path) -> dict[str, Any]:
    out = {}
    for conc in sizes.concurrencies:
        cfg = BenchConfig(base_url=url, model="bench", endpoint="completions",
                          input_len=sizes.serving_input, output_len=sizes.serving_output,
                          num_requests=max(2 * conc, 4), concurrency=conc,
                          tokenizer=str(model_dir), is_progress_shown=False,
                          max_duration_s=60)  # fmt: skip
        s = await run_benchmark(cfg)
        out[str(conc)] = {"output_tok_s": s["output_throughput"], "ttft_ms": s["ttft_ms"],
                          "tpot_ms": s["tpot_ms"], "errors": s["num_errors"]}  # fmt: skip
    return out


async def _pd(device: str, sizes: Any, model_dir: Path, budget_s: float) -> tuple[list, dict]:
    args = worker_args(device, max(sizes.concurrencies), 0.3)
    spec = ClusterSpec(model_dir=str(model_dir), served_model_name="bench", worker_args=args,
                       router_args=(), max_ready_s=budget_s)  # fmt: skip
    async with Cluster(spec) as cluster:
        greedy = await _greedy(cluster.session, cluster.router.url, sizes.greedy_tokens, 60)
        return greedy, await _serve_figures(cluster.router.url, sizes, model_dir)


async def _colocated(device: str, sizes: Any, model_dir: Path, budget_s: float) -> tuple:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="pdserve-gpu-check-")) / "colocated.log"
    proc = ManagedProc("colocated", "colocated",
                       ["serve", "--role", "colocated", "--model", str(model_dir), "--port",
                        str(port), "--served-model-name", "bench",
                        *worker_args(device, max(sizes.concurrencies), 0.6)],
                       f"http://127.0.0.1:{port}", log)  # fmt: skip
    async with aiohttp.ClientSession() as session:
        proc.start()
        try:
            await proc.wait_ready(session, budget_s)
            greedy = await _greedy(session, proc.url, sizes.greedy_tokens, 60)
            return greedy, await _serve_figures(proc.url, sizes, model_dir)
        finally:
            await asyncio.to_thread(proc.stop)


async def _within(coro: Any, seconds: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(coro, seconds)
    except TimeoutError:
        raise TimeoutError(f"{what} did not finish within its {seconds:.0f} s budget") from None


def pd_vs_colocated(device: str, sizes: Any, model_dir: Path, budget_s: float) -> dict[str, Any]:
    """Both deployments in turn; ``mismatched`` names the prompts whose greedy texts differ."""
    pd_s = budget_s * PD_SHARE
    pd_text, pd_serving = asyncio.run(
        _within(_pd(device, sizes, model_dir, pd_s), pd_s, "PD")
    )  # fmt: skip
    co_s = budget_s - pd_s
    co_text, co_serving = asyncio.run(
        _within(_colocated(device, sizes, model_dir, co_s), co_s, "colocated")
    )  # fmt: skip
    mismatched = [i for i, (a, b) in enumerate(zip(pd_text, co_text, strict=True)) if a != b]
    ratios = {k: pd_serving[k]["output_tok_s"] / max(co_serving[k]["output_tok_s"], 1e-9)
              for k in pd_serving}  # fmt: skip
    errors = sum(v["errors"] for v in (*pd_serving.values(), *co_serving.values()))
    return {"greedy_equal": not mismatched, "mismatched_prompts": mismatched,
            "pd_serving": pd_serving, "colocated_serving": co_serving,
            "pd_over_colocated_throughput": ratios, "errors": errors}  # fmt: skip
