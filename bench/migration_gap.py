"""How long a stream cut mid-answer waits for its next token, against a fresh prompt's TTFT.

A PD cluster (1 prefill, 2 decodes, the router's migration on, as by default) streams a request of
``--prompt-len`` token ids and ``--max-tokens`` tokens (ignore_eos); after ``--kill-after``
tokens the decode serving it is SIGKILLed. The router resumes the stream on the other decode,
which prefills prompt + streamed tokens once (pdserve's migration: one prefill, never a replay
of each token). Reported per round: the gap from the kill to the stream's next token, and the
TTFT of a fresh request whose prompt is as long as that resumed prefill (prompt + streamed
tokens), measured on the same cluster just before; the issue's goal is gap <= 2x that TTFT.

    python bench/migration_gap.py [--model-dir DIR] [--prompt-len 512] [--kill-after 32]

Without ``--model-dir`` it serves the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF), else
the demo model.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from anywhere

from bench.cluster import Cluster, ClusterSpec, ManagedProc, get_json, scrape  # noqa: E402
from bench.sse import sse_events  # noqa: E402
from pdserve.cli_common import run_async  # noqa: E402
from pdserve.model.demo import ensure_demo_model  # noqa: E402
from pdserve.model.fetch import FetchError, fetch_model  # noqa: E402

STREAM_TIMEOUT_S = 300.0


@dataclass
class Round:
    ttft_fresh_s: float  # a fresh prompt as long as the resumed prefill
    gap_s: float  # kill -> the stream's next token
    num_tokens: int  # tokens the cut stream delivered in all (its usage)
    migrations: int


def token_prompt(length: int, salt: int) -> list[int]:
    return [(salt * 31 + 7 * i) % 230 + 20 for i in range(length)]  # no specials, any vocab


def body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


async def ttft(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
    async with session.post(f"{url}/v1/completions", data=orjson.dumps(body(prompt, 2)),
                            timeout=timeout) as resp:  # fmt: skip
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {await resp.text()}")
        first = None
        async for ev in sse_events(resp):
            if first is None and ev.data and any(c.get("text") for c in ev.data["choices"]):
                first = ev.at
        assert first is not None, "no token"
        return first - start


async def serving_decode(session: aiohttp.ClientSession, cluster: Cluster) -> ManagedProc:
    (req,) = (await get_json(session, f"{cluster.router.url}/debug/requests"))["data"]
    (url,) = [leg["worker"] for leg in req["legs"] if leg["role"] == "decode"]
    return next(d for d in cluster.decodes if d.url == url)


async def migrations(session: aiohttp.ClientSession, url: str) -> int:
    return int((await scrape(session, url)).get("pdserve_router_migrations_total", 0))


async def one_round(cluster: Cluster, args: argparse.Namespace, salt: int) -> Round:
    session, url = cluster.session, cluster.router.url
    prompt = token_prompt(args.prompt_len, salt)
    fresh = await ttft(session, url, token_prompt(args.prompt_len + args.kill_after, salt + 1000))
    before = await migrations(session, url)
    killed_at, gap, count, num_tokens = None, None, 0, 0
    timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
    data = orjson.dumps(body(prompt, args.max_tokens))
    async with session.post(f"{url}/v1/completions", data=data, timeout=timeout) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {await resp.text()}")
        async for ev in sse_events(resp):
            if ev.data and "error" in ev.data:
                raise RuntimeError(f"the stream ended with an error: {ev.data['error']}")
            if ev.data and ev.data.get("usage"):
                num_tokens = ev.data["usage"]["completion_tokens"]
            if not ev.data or not ev.data["choices"]:
                continue
            count += 1  # a streamed step (its text may be empty: bytes held for UTF-8)
            if killed_at is not None and gap is None:
                gap = ev.at - killed_at
            if count == args.kill_after and killed_at is None:
                victim = await serving_decode(session, cluster)
                await asyncio.to_thread(victim.kill)
                killed_at = time.perf_counter()
    assert gap is not None, "the stream ended before the kill or never resumed"
    moved = await migrations(session, url) - before
    await cluster.restart(victim)  # both decodes again for the next round
    await cluster.wait_router_sees_all()
    return Round(fresh, gap, num_tokens, moved)


async def run(args: argparse.Namespace) -> list[Round]:
    spec = ClusterSpec(model_dir=str(args.model_dir), served_model_name="bench", num_decode=2)
    async with Cluster(spec) as cluster:
        await ttft(cluster.session, cluster.router.url, token_prompt(16, 0))  # warm both roles
        return [await one_round(cluster, args, salt) for salt in range(args.rounds)]


def default_model() -> Path:
    try:
        return fetch_model()
    except FetchError:
        return ensure_demo_model()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--kill-after", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.kill_after >= args.max_tokens:
        ap.error("--kill-after must be below --max-tokens")
    args.model_dir = args.model_dir or default_model()
    rounds = run_async(run(args))
    print(f"model {args.model_dir}, prompt {args.prompt_len}, cut after {args.kill_after}")
    print(f"{'round':>5} {'fresh TTFT (prompt+cut) ms':>27} {'gap ms':>8} {'x TTFT':>7} "
          f"{'tokens':>7} {'migrations':>11}")  # fmt: skip
    for i, r in enumerate(rounds):
        print(f"{i:>5} {r.ttft_fresh_s * 1e3:>27.1f} {r.gap_s * 1e3:>8.1f} "
              f"{r.gap_s / r.ttft_fresh_s:>7.2f} {r.num_tokens:>7} {r.migrations:>11}")  # fmt: skip
    ratio = statistics.median(r.gap_s / r.ttft_fresh_s for r in rounds)
    print(f"median gap / fresh TTFT: {ratio:.2f} (goal <= 2)")
    complete = all(r.num_tokens == args.max_tokens and r.migrations == 1 for r in rounds)
    return 0 if complete else 1


if __name__ == "__main__":
    raise SystemExit(main())
