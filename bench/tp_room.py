"""The time a long room takes between TP sizes: P1 -> D{N} beside P1 -> D1, same prompts.

Run: ``python bench/tp_room.py [--model DIR] [--decode-tp 2] [--tokens 4000] [--reps 5]``.
Each rep sends one prompt of ``--tokens`` token ids (max_tokens 1) through each cluster in
turn; the prefill's ``pdserve_kv_transfer_seconds`` (first WRITE posted to last WRITE done)
gives the room's transfer time. A TP engine's pool is a shared file (4 KiB pages) where a TP1
pool is huge-page memory: this is what the comparison shows. Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from typing import Any

import aiohttp

from bench.cluster import Cluster, ClusterSpec, scrape
from pdserve.model.demo import ensure_demo_model


async def _room_seconds(cluster: Cluster, ids: list[int]) -> float:
    """One request's prefill transfer time (the histogram's sum grows by exactly that)."""
    url = cluster.prefills[0].url
    before = (await scrape(cluster.session, url)).get("pdserve_kv_transfer_seconds_sum", 0.0)
    body = {"model": "demo", "prompt": ids, "max_tokens": 1, "temperature": 0}
    timeout = aiohttp.ClientTimeout(total=900)
    completions = f"{cluster.router.url}/v1/completions"
    async with cluster.session.post(completions, json=body, timeout=timeout) as r:
        assert r.status == 200, await r.text()
    after = (await scrape(cluster.session, url)).get("pdserve_kv_transfer_seconds_sum", 0.0)
    return after - before


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = str(args.model or ensure_demo_model())
    worker_args = (
        "--kv-cache-mb",
        str(args.kv_cache_mb),
        "--num-threads",
        "1",
        "--max-model-len",
        str(args.tokens + 16),
        "--timeout-request",
        "900",
    )
    # fmt: skip
    router_args = ("--policy", "round_robin", "--request-timeout", "900")  # long prefills
    base = ClusterSpec(model_dir=model, worker_args=worker_args, router_args=router_args)
    tp = ClusterSpec(
        model_dir=model,
        worker_args=worker_args,
        router_args=router_args,
        decode_args=("-tp", str(args.decode_tp)),
    )
    rng = random.Random(0)
    out: dict[str, Any] = {"tokens": args.tokens, "reps": args.reps}
    times: dict[str, list[float]] = {"d1": [], f"d{args.decode_tp}": []}
    async with Cluster(base) as c1, Cluster(tp) as cn:
        for _ in range(args.reps):
            ids = [rng.randrange(10, 4000) for _ in range(args.tokens)]
            times["d1"].append(await _room_seconds(c1, ids))
            times[f"d{args.decode_tp}"].append(await _room_seconds(cn, ids))
    for name, ts in times.items():
        out[f"p1_{name}_room_ms"] = round(sorted(ts)[len(ts) // 2] * 1e3, 3)
        out[f"p1_{name}_all_ms"] = [round(t * 1e3, 3) for t in ts]
    out["ratio"] = round(out[f"p1_d{args.decode_tp}_room_ms"] / out["p1_d1_room_ms"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="default: the demo model")
    ap.add_argument("--decode-tp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kv-cache-mb", type=int, default=512)
    print(json.dumps(asyncio.run(main_async(ap.parse_args())), indent=1))


if __name__ == "__main__":
    main()
