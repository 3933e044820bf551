"""KV reuse (issue 14): prefix caching and chunked prefill, measured side by side in one run.

    python bench/reuse_compare.py --scenario shared_prefix --model-dir /work/models/tiny \\
        --vllm-python /work/vllm-venv/bin/python --json-out reuse.json
    python bench/reuse_compare.py --scenario long_prompt --model-dir /work/models/small

``shared_prefix``: bench/serving.py's ``prefix_repetition`` load (``--num-prefixes`` groups of
a ``--prefix-len``-token prefix plus ``--input-len`` unique tokens, ``--output-len`` out, at
``--concurrency``) against each deployment in turn: ``colocated`` (prefix caching on, the
default), ``colocated-nocache``, ``pd`` (router + prefill + decode sharing one CPU lease, as
``pdserve up`` runs them; KV bytes sent per request from the prefill's
``pdserve_transport_bytes_sent_total``), optionally ``pd-nocache``, and vLLM with its prefix
caching on (``--vllm-python``). Ratios: TTFT nocache/cache, throughput / vLLM.

``long_prompt``: ``--num-streams`` streams decode on one colocated worker; once every one of
them streams, a ``--long-len``-token prompt arrives (each stream runs until it has a token
after the long prompt's first, so it spans the whole prefill on any machine). The streams'
inter-token gaps that overlap its prefill window (arrival to first token) give ITL p50/p99,
against the streams' median ITL over the whole run; once without chunked prefill, then with
it at each step budget of ``--max-num-batched-tokens`` (a comma list sweeps the trade-off
between the streams' stalls and the long prompt's TTFT).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import workloads  # noqa: E402
from bench.cluster import Cluster, ClusterSpec, ManagedProc, free_port, get_json, scrape  # noqa: E402
from bench.pd_compare import (  # noqa: E402
    PERF_ARGS,
    checkpoint,
    shared_lease_args,
    summary_metric,
)
from bench.serving import BenchConfig, run_benchmark  # noqa: E402
from bench.timed_stream import Stream, pct_ms, stream, window_itls  # noqa: E402
from bench.vllm_ref import VllmServer  # noqa: E402
from pdserve.cli_common import run_async  # noqa: E402

SCENARIOS = ("shared_prefix", "long_prompt")
DEPLOYMENTS = ("colocated", "colocated-nocache", "pd", "pd-nocache", "vllm")
BYTES_SENT = "pdserve_transport_bytes_sent_total"
READY_S = ClusterSpec(model_dir="").max_ready_s


@asynccontextmanager
async def colocated(model_dir: Path, worker_args: list[str]) -> AsyncIterator[ManagedProc]:
    """One colocated worker on a free port, ready, stopped on exit."""
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="pdserve-reuse-")) / "colocated.log"
    proc = ManagedProc("colocated", "colocated",
                       ["serve", "--role", "colocated", "--model", str(model_dir), "--port",
                        str(port), "--served-model-name", "bench", *worker_args],
                       f"http://127.0.0.1:{port}", log)  # fmt: skip
    async with aiohttp.ClientSession() as session:
        proc.start()
        try:
            await proc.wait_ready(session, READY_S)
            yield proc
        finally:
            await asyncio.to_thread(proc.stop)


# ---- shared_prefix ----------------------------------------------------------------------


def prefix_config(url: str, model_dir: Path, args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=url, model="bench", endpoint="completions", dataset="prefix_repetition",
        num_prefixes=args.num_prefixes, prefix_len=args.prefix_len, input_len=args.input_len,
        output_len=args.output_len, num_requests=args.num_requests, concurrency=args.concurrency,
        tokenizer=str(model_dir), is_progress_shown=False, num_warmup=args.num_warmup,
        timeout_s=args.request_timeout,
    )  # fmt: skip


async def bench_deployment(dep: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    worker_args = [*args.worker_args, *(["--no-prefix-caching"] if "nocache" in dep else [])]
    print(f"{dep}: starting", flush=True)
    if dep == "vllm":
        server = VllmServer(args.vllm_python, model_dir, free_port(), prefix_caching=True,
                            max_model_len=max(2048, args.prefix_len + args.input_len
                                              + args.output_len + 64))  # fmt: skip
        async with server:
            return await run_benchmark(prefix_config(server.url, model_dir, args))
    if dep.startswith("colocated"):
        async with colocated(model_dir, worker_args) as proc:
            return await run_benchmark(prefix_config(proc.url, model_dir, args))
    # Both workers share this machine's cores: one CPU lease, as `pdserve up` gives them.
    lease = shared_lease_args()
    spec = ClusterSpec(model_dir=str(model_dir), served_model_name="bench",
                       worker_args=(*worker_args, *lease), router_args=())  # fmt: skip
    async with Cluster(spec) as cluster:
        prefill = cluster.prefills[0].url
        before = (await scrape(cluster.session, prefill)).get(BYTES_SENT, 0.0)
        summary = await run_benchmark(prefix_config(cluster.router.url, model_dir, args))
        after = (await scrape(cluster.session, prefill)).get(BYTES_SENT, 0.0)
    # The warm-up requests went through the prefill too.
    num_sent = summary["num_completed"] + args.num_warmup
    summary["kv_bytes_sent_per_request"] = (after - before) / num_sent if num_sent else None
    return summary


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def report_shared_prefix(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rows = []
    ref = summary_metric(results.get("vllm"), "output_throughput")
    print(f"\n== shared_prefix ==\n{'deployment':<19}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'TPOT p50':>10}{'tok/s':>9}{'hit rate':>10}{'KV B/req':>12}{'x vLLM':>8}")  # fmt: skip
    for dep, s in results.items():
        row = {"deployment": dep, "ttft_p50_ms": summary_metric(s, "ttft_ms", "p50"),
               "ttft_p99_ms": summary_metric(s, "ttft_ms", "p99"),
               "tpot_p50_ms": summary_metric(s, "tpot_ms", "p50"),
               "tok_s": summary_metric(s, "output_throughput"),
               "prefix_cache_hit_rate": summary_metric(s, "prefix_cache_hit_rate"),
               "kv_bytes_sent_per_request": summary_metric(s, "kv_bytes_sent_per_request"),
               "errors": s["num_errors"]}  # fmt: skip
        row["x_vllm"] = _ratio(row["tok_s"], ref)
        rows.append(row)
        cells = [
            row[k]
            for k in (
                "ttft_p50_ms",
                "ttft_p99_ms",
                "tpot_p50_ms",
                "tok_s",
                "prefix_cache_hit_rate",
                "kv_bytes_sent_per_request",
                "x_vllm",
            )
        ]
        widths = (10, 10, 10, 9, 10, 12, 8)
        print(f"{dep:<19}" + "".join(f"{v:>{w}.2f}" if v is not None else f"{'-':>{w}}"
                                      for v, w in zip(cells, widths, strict=True)))  # fmt: skip
    by = {r["deployment"]: r for r in rows}

    def nocache_over_cache(base: str) -> float | None:
        return _ratio((by.get(f"{base}-nocache") or {}).get("ttft_p50_ms"),
                      (by.get(base) or {}).get("ttft_p50_ms"))  # fmt: skip

    ratios = {"ttft_nocache_over_cache_colocated": nocache_over_cache("colocated"),
              "ttft_nocache_over_cache_pd": nocache_over_cache("pd"),
              "pd_kv_bytes_cache_over_nocache": _ratio(
                  (by.get("pd") or {}).get("kv_bytes_sent_per_request"),
                  (by.get("pd-nocache") or {}).get("kv_bytes_sent_per_request"))}  # fmt: skip
    print("  ".join(f"{k} {v:.2f}" for k, v in ratios.items() if v is not None))
    return {"rows": rows, "ratios": ratios, "summaries": results}


async def run_shared_prefix(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    results = {dep: await bench_deployment(dep, model_dir, args) for dep in args.deps}
    return report_shared_prefix(results)


# ---- long_prompt ------------------------------------------------------------------------


async def streams_and_long_prompt(
    url: str, model_dir: Path, args: argparse.Namespace
) -> tuple[list[Stream], Stream, int]:
    """Start the streams; once each streams, send the long prompt; wait for them all. Each
    stream runs until it has a token after the long prompt's first one (and at least
    ``--stream-output-len``): its gaps cover the long prompt's prefill by construction."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        info = await get_json(session, f"{url}/server_info")
        max_len = int(info["max_model_len"])
        long_len = min(args.long_len, max_len - args.long_output_len - 1)
        stream_bound = max(args.stream_output_len, max_len - args.stream_input_len - 16)
        tok = str(model_dir)
        short = workloads.make_prompts("random", args.num_streams + 1, args.stream_input_len,
                                       seed=1, tokenizer=tok)  # fmt: skip
        (long_prompt,) = workloads.make_prompts("random", 1, long_len, seed=2, tokenizer=tok)
        warm = Stream()  # compiles / warms the runner, so the first stream is not an outlier
        await stream(session, url, short[-1], 4, warm, None, args.request_timeout)
        if warm.error:
            raise RuntimeError(f"warm-up failed: {warm.error}")
        started = [asyncio.Event() for _ in range(args.num_streams)]
        streams = [Stream() for _ in range(args.num_streams)]
        long = Stream()
        tasks = [asyncio.create_task(stream(session, url, short[i], stream_bound, streams[i],
                                            started[i], args.request_timeout, until=long,
                                            min_tokens=args.stream_output_len))
                 for i in range(args.num_streams)]  # fmt: skip
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)),
                                   args.request_timeout)  # fmt: skip
            await stream(session, url, long_prompt, args.long_output_len, long, None,
                         args.request_timeout)  # fmt: skip
            await asyncio.wait_for(asyncio.gather(*tasks), args.request_timeout)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return streams, long, long_len


async def long_prompt_once(model_dir: Path, args: argparse.Namespace, budget: int | None) -> dict:
    """One colocated worker: chunked with ``budget`` tokens per step, or unchunked (None)."""
    chunked = budget is not None
    step_tokens = budget if chunked else max(args.long_len, 2048) + 64
    flags = [
        "--max-num-batched-tokens",
        str(step_tokens),
        *([] if chunked else ["--no-chunked-prefill"]),
    ]
    async with colocated(model_dir, [*args.worker_args, *flags]) as proc:
        streams, long, long_len = await streams_and_long_prompt(proc.url, model_dir, args)
    errors = [s.error for s in [*streams, long] if s.error]
    if errors or not long.token_times:
        raise RuntimeError(f"long_prompt requests failed: {errors[:3] or 'no tokens'}")
    first = long.token_times[0]
    window = window_itls(streams, long.sent_at, first)
    all_itls = window_itls(streams, -np.inf, np.inf)
    p50_all = pct_ms(all_itls, 50)
    p99_win = pct_ms(window, 99)
    still = sum(1 for s in streams if s.token_times[-1] > first)
    return {"chunked": chunked, "max_num_batched_tokens": step_tokens, "long_len": long_len,
            "long_ttft_ms": (first - long.sent_at) * 1000.0,
            "window_itl_p50_ms": pct_ms(window, 50), "window_itl_p99_ms": p99_win,
            "all_itl_p50_ms": p50_all, "num_window_itls": len(window),
            "streams_running_after_first_token": still,
            "window_p99_over_median": _ratio(p99_win, p50_all)}  # fmt: skip


async def run_long_prompt(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Unchunked first, then chunked at each budget of ``--max-num-batched-tokens`` (a comma
    list sweeps the trade-off: smaller chunks, shorter stalls, more steps to the first token).
    The first budget's run is ``runs["chunked"]``, the others ``runs["chunked-<budget>"]``."""
    budgets = args.max_num_batched_tokens
    runs: dict[str, dict[str, Any]] = {}
    print("long_prompt: unchunked", flush=True)
    runs["unchunked"] = await long_prompt_once(model_dir, args, None)
    for i, budget in enumerate(budgets):
        print(f"long_prompt: chunked, {budget} tokens per step", flush=True)
        runs["chunked" if i == 0 else f"chunked-{budget}"] = await long_prompt_once(
            model_dir, args, budget
        )
    base = runs["unchunked"]["long_ttft_ms"]
    ratios = {"ttft_chunked_over_unchunked": _ratio(runs["chunked"]["long_ttft_ms"], base)}
    print(f"\n== long_prompt: {args.num_streams} streams + a {runs['chunked']['long_len']}-token "
          f"prompt ==\n{'mode':<11}{'budget':>7}{'TTFT ms':>10}{'x unch':>8}{'ITL p50':>9}"
          f"{'ITL p99':>9}{'median':>9}{'p99/med':>9}{'gaps':>6}")  # fmt: skip
    for name, r in runs.items():
        r["ttft_over_unchunked"] = _ratio(r["long_ttft_ms"], base)
        cells = [r["window_itl_p50_ms"], r["window_itl_p99_ms"], r["all_itl_p50_ms"],
                 r["window_p99_over_median"]]  # fmt: skip
        print(f"{name:<11}{r['max_num_batched_tokens']:>7}{r['long_ttft_ms']:>10.1f}"
              f"{r['ttft_over_unchunked'] or 0:>8.2f}" + "".join(
            f"{v:>9.2f}" if v is not None else f"{'-':>9}" for v in cells
        ) + f"{r['num_window_itls']:>6}")  # fmt: skip
    return {"runs": runs, "ratios": ratios}


# ---- command line -----------------------------------------------------------------------


def _budgets(text: str) -> list[int]:
    try:
        budgets = [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of token counts: {text!r}") from None
    if not budgets or min(budgets) < 1:
        raise argparse.ArgumentTypeError(f"budgets must be positive: {text!r}")
    return budgets


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scenario", default="shared_prefix,long_prompt", help="comma list")
    p.add_argument("--config", default="demo", help="demo, tiny or small (pd_compare's SHAPES)")
    p.add_argument("--model-dir", default=None, help="a written checkpoint (over --config)")
    p.add_argument("--worker-args", default=" ".join(PERF_ARGS), help="pdserve worker flags")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds, each wait")
    p.add_argument("--json-out", default=None)
    g = p.add_argument_group("shared_prefix")
    g.add_argument(
        "--deployments",
        default="colocated,colocated-nocache,pd",
        help=f"comma list of {', '.join(DEPLOYMENTS)} (vllm: with --vllm-python)",
    )
    g.add_argument("--vllm-python", default=None, help="adds vLLM (prefix caching on)")
    g.add_argument("--num-prefixes", type=int, default=16)
    g.add_argument("--prefix-len", type=int, default=1024)
    g.add_argument("--input-len", type=int, default=64, help="unique tokens per request")
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--concurrency", type=int, default=8)
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument("--num-warmup", type=int, default=1)
    g = p.add_argument_group("long_prompt")
    g.add_argument("--num-streams", type=int, default=8)
    g.add_argument("--stream-input-len", type=int, default=32)
    g.add_argument("--stream-output-len", type=int, default=256,
                   help="tokens each stream decodes at least (and until the long prompt's first "
                   "token has arrived)")  # fmt: skip
    g.add_argument("--long-len", type=int, default=4096, help="capped by max_model_len")
    g.add_argument("--long-output-len", type=int, default=8)
    g.add_argument("--max-num-batched-tokens", type=_budgets, default=[256],
                   help="the chunked runs' step budgets, a comma list (one run each)")  # fmt: skip
    args = p.parse_args(argv)
    args.scenarios = args.scenario.split(",")
    args.deps = args.deployments.split(",")
    if args.vllm_python and "vllm" not in args.deps:
        args.deps.append("vllm")
    bad = [s for s in args.scenarios if s not in SCENARIOS] + [
        d for d in args.deps if d not in DEPLOYMENTS
    ]
    if bad or ("vllm" in args.deps and not args.vllm_python):
        p.error(f"unknown scenario/deployment {bad} (vllm needs --vllm-python)")
    args.worker_args = shlex.split(args.worker_args)
    return args


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-ckpt-") as tmp:
        model_dir = checkpoint(args.config, Path(tmp), args.model_dir)
        if "shared_prefix" in args.scenarios:
            out["shared_prefix"] = await run_shared_prefix(model_dir, args)
        if "long_prompt" in args.scenarios:
            out["long_prompt"] = await run_long_prompt(model_dir, args)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = run_async(run_all(args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    errors = sum(r["errors"] for r in out.get("shared_prefix", {}).get("rows", []))
    print(f"\nrequests that failed: {errors}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
