"""A soak of KV handed between TP sizes: the same requests through a P{M} -> D{N} cluster and a
P1 -> D1 one, every output compared, then both clusters checked idle (no request, room, fenced
or referenced page left on any worker).

Run: ``python bench/tp_soak.py [--model DIR] [--prefill-tp 2] [--decode-tp 1] [--requests 1000]
[--concurrency 16]``. Prompts and lengths are drawn from a seeded generator; requests are greedy
(``ignore_eos``), so equal outputs are the bit-identity promise across TP sizes. Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import aiohttp

from bench.cluster import Cluster, ClusterSpec, check_idle
from pdserve.model.demo import ensure_demo_model

WORDS = [
    "the",
    "page",
    "room",
    "rank",
    "head",
    "layer",
    "token",
    "cache",
    "prefill",
    "decode",
    "quick",
    "brown",
    "fox",
    "def",
    "return",
]


def _requests(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "model": "demo",
            "prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 120))),
            "max_tokens": rng.randint(1, 16),
            "temperature": 0,
            "ignore_eos": True,
        }  # fmt: skip
        for _ in range(n)
    ]


async def _run(
    cluster: Cluster, requests: list[dict[str, Any]], concurrency: int
) -> list[str | None]:
    """Each request's text (None: it failed), at most ``concurrency`` in flight."""
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=300)

    async def one(body: dict[str, Any]) -> str | None:
        async with gate:
            try:
                async with cluster.session.post(
                    f"{cluster.router.url}/v1/completions", json=body, timeout=timeout
                ) as r:
                    data = await r.json()
                    return data["choices"][0]["text"] if r.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, KeyError):
                return None

    return list(await asyncio.gather(*(one(b) for b in requests)))


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = str(args.model or ensure_demo_model())
    requests = _requests(args.requests, args.seed)
    tp = ("-tp", str(args.prefill_tp)), ("-tp", str(args.decode_tp))
    specs = {
        "tp": ClusterSpec(model_dir=model, prefill_args=tp[0], decode_args=tp[1]),
        "tp1": ClusterSpec(model_dir=model),
    }
    out: dict[str, Any] = {
        "pair": f"P{args.prefill_tp}->D{args.decode_tp}",
        "requests": len(requests),
    }
    texts: dict[str, list[str | None]] = {}
    async with Cluster(specs["tp"]) as tp_cluster, Cluster(specs["tp1"]) as tp1_cluster:
        for name, cluster in (("tp", tp_cluster), ("tp1", tp1_cluster)):
            t0 = time.monotonic()
            texts[name] = await _run(cluster, requests, args.concurrency)
            out[f"{name}_seconds"] = round(time.monotonic() - t0, 1)
            report = await check_idle(cluster.session, cluster.target())
            out[f"{name}_idle"] = report.is_idle
            out[f"{name}_failed"] = sum(t is None for t in texts[name])
    out["differing"] = sum(a != b for a, b in zip(texts["tp"], texts["tp1"], strict=True))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="default: the demo model")
    ap.add_argument("--prefill-tp", type=int, default=2)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    print(json.dumps(asyncio.run(main_async(ap.parse_args())), indent=1))


if __name__ == "__main__":
    main()
