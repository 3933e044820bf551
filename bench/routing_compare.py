"""Routing policies on a 2 prefill x 2 decode fleet, side by side in one run (issue 24).

    python bench/routing_compare.py --json-out routing.json

Each policy (``--policies``, default round_robin, power_of_two, cache_aware) gets a fresh
fleet: ``--num-prefill`` prefills and ``--num-decode`` decodes sharing one CPU lease (as
``pdserve up`` runs them) behind a router started with ``--policy P``, and bench/serving.py's
``prefix_repetition`` load: ``--num-prefixes`` groups of a ``--prefix-len``-token prefix plus
``--input-len`` unique tokens, ``--output-len`` out, at ``--concurrency``.

Reported per policy: the prefills' prefix-cache hit rate (hit tokens / looked-up tokens, from
their ``pdserve_prefix_cache_*_tokens`` counters, before and after the load), the decodes' (a
decode holding the prefix receives only the rest of the KV), TTFT p50/p99, output throughput
and how the requests split over the prefills.

Two choices make the comparison mean something: the number of prefixes is odd by default, as
round robin over 2 prefills would otherwise send each prefix to one prefill by accident
(requests cycle through the groups); and each worker's KV pool (``--kv-cache-mb``) is sized to
hold about ``--fit-prefixes`` of the prefixes, fewer than all of them: the regime where where a
prefix lands matters, because a worker that sees every prefix evicts what it cached before it
is asked again.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster import Cluster, ClusterSpec, scrape  # noqa: E402
from bench.pd_compare import checkpoint, shared_lease_args, summary_metric  # noqa: E402
from bench.serving import BenchConfig, run_benchmark  # noqa: E402
from pdserve.cli_common import run_async  # noqa: E402
from pdserve.model.config import ModelConfig  # noqa: E402

POLICIES = ("round_robin", "power_of_two", "cache_aware", "least_loaded", "random")
HIT, QUERY, QUERIES = (
    "pdserve_prefix_cache_hit_tokens_total",
    "pdserve_prefix_cache_query_tokens_total",
    "pdserve_prefix_cache_queries_total",
)
BASE_WORKER_ARGS = "--heartbeat-interval 1.0 --num-threads 1"


def kv_cache_mb(model_dir: Path, tokens: int) -> int:
    """MiB of a bf16 KV pool that holds ``tokens`` tokens of this model (at least 1)."""
    cfg = ModelConfig.from_dir(model_dir)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, 2 bytes
    return max(1, round(tokens * per_token / (1 << 20)))


async def _counters(cluster: Cluster) -> dict[str, dict[str, float]]:
    out = {}
    for proc in cluster.workers:
        m = await scrape(cluster.session, proc.url)
        out[proc.name] = {k: m.get(k, 0.0) for k in (HIT, QUERY, QUERIES)}
    return out


def _hit_rate(before: dict, after: dict, prefix: str) -> float | None:
    names = [n for n in after if n.startswith(prefix)]
    hit = sum(after[n][HIT] - before[n][HIT] for n in names)
    query = sum(after[n][QUERY] - before[n][QUERY] for n in names)
    return hit / query if query else None


async def bench_policy(policy: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    print(f"{policy}: starting {args.num_prefill}P x {args.num_decode}D", flush=True)
    worker_args = (*args.worker_args, "--kv-cache-mb", str(args.kv_cache_mb), *shared_lease_args())
    spec = ClusterSpec(
        model_dir=str(model_dir), served_model_name="bench", num_prefill=args.num_prefill,
        num_decode=args.num_decode, worker_args=worker_args, router_args=("--policy", policy),
    )  # fmt: skip
    async with Cluster(spec) as cluster:
        cfg = BenchConfig(
            base_url=cluster.router.url, model="bench", endpoint="completions",
            dataset="prefix_repetition", num_prefixes=args.num_prefixes,
            prefix_len=args.prefix_len, input_len=args.input_len, output_len=args.output_len,
            num_requests=args.num_requests, concurrency=args.concurrency,
            tokenizer=str(model_dir), is_progress_shown=False, num_warmup=0,
            timeout_s=args.request_timeout, seed=args.seed,
        )  # fmt: skip
        before = await _counters(cluster)
        summary = await run_benchmark(cfg)
        after = await _counters(cluster)
    split = {
        n: after[n][QUERIES] - before[n][QUERIES] for n in after if n.startswith("prefill")
    }  # fmt: skip
    return {
        "policy": policy,
        "prefill_hit_rate": _hit_rate(before, after, "prefill"),
        "decode_hit_rate": _hit_rate(before, after, "decode"),
        "ttft_p50_ms": summary_metric(summary, "ttft_ms", "p50"),
        "ttft_p99_ms": summary_metric(summary, "ttft_ms", "p99"),
        "tpot_p50_ms": summary_metric(summary, "tpot_ms", "p50"),
        "tok_s": summary_metric(summary, "output_throughput"),
        "req_s": summary_metric(summary, "request_throughput"),
        "requests_per_prefill": split,
        "errors": summary["num_errors"],
        "first_errors": summary["first_errors"],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    cols = ("prefill_hit_rate", "decode_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "tok_s", "req_s")
    print(f"\n{'policy':<14}{'P hit':>8}{'D hit':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'tok/s':>8}{'req/s':>7}  requests per prefill, errors")  # fmt: skip
    for r in rows:
        cells = "".join(
            f"{r[c]:>{w}.2f}" if r[c] is not None else f"{'-':>{w}}"
            for c, w in zip(cols, (8, 8, 10, 10, 8, 7), strict=True)
        )
        split = ",".join(f"{v:g}" for v in r["requests_per_prefill"].values())
        print(f"{r['policy']:<14}{cells}  {split}, {r['errors']}")
    by = {r["policy"]: r for r in rows}
    ca, rr = by.get("cache_aware"), by.get("round_robin")
    ratios: dict[str, float | None] = {}
    if ca and rr:
        ratios = {
            "hit_rate_cache_aware_over_round_robin": _ratio(
                ca["prefill_hit_rate"], rr["prefill_hit_rate"]
            ),
            "ttft_p50_cache_aware_over_round_robin": _ratio(ca["ttft_p50_ms"], rr["ttft_p50_ms"]),
        }
        print("  ".join(f"{k} {v:.2f}" for k, v in ratios.items() if v is not None))
    return {"rows": rows, "ratios": ratios}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--policies", default="round_robin,power_of_two,cache_aware")
    p.add_argument("--config", default="demo", help="demo, tiny or small (pd_compare's SHAPES)")
    p.add_argument("--model-dir", default=None, help="a written checkpoint (over --config)")
    p.add_argument("--num-prefill", type=int, default=2)
    p.add_argument("--num-decode", type=int, default=2)
    p.add_argument("--worker-args", default=BASE_WORKER_ARGS, help="pdserve worker flags")
    p.add_argument("--kv-cache-mb", type=int, default=None, help="default: from --fit-prefixes")
    p.add_argument("--fit-prefixes", type=float, default=9.0,
                   help="prefixes (with their requests) one worker's KV pool holds")  # fmt: skip
    p.add_argument("--num-prefixes", type=int, default=15)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=32, help="unique tokens per request")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    args.policy_list = args.policies.split(",")
    bad = [x for x in args.policy_list if x not in POLICIES]
    if bad:
        p.error(f"unknown policies {bad}; choose from {POLICIES}")
    args.worker_args = shlex.split(args.worker_args)
    return args


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pdserve-ckpt-") as tmp:
        model_dir = checkpoint(args.config, Path(tmp), args.model_dir)
        if args.kv_cache_mb is None:
            per_prefix = args.prefix_len + args.input_len + args.output_len
            args.kv_cache_mb = kv_cache_mb(model_dir, round(args.fit_prefixes * per_prefix))
        print(f"KV pool per worker: {args.kv_cache_mb} MiB", flush=True)
        rows = [await bench_policy(policy, model_dir, args) for policy in args.policy_list]
    out = report(rows)
    out["kv_cache_mb"] = args.kv_cache_mb
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = run_async(run_all(args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    errors = sum(r["errors"] for r in out["rows"])
    print(f"\nrequests that failed: {errors}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
