"""The router's own latency overhead per request, with no model anywhere.

Runs, in one process and on 127.0.0.1: an ``InstantWorkerDouble`` prefill and decode pair
(bench doubles that answer at once with made-up tokens, no model), a real pdserve Router in PD
mode in front of them, and a client. The same streaming request goes alternately straight to
the decode double and through the router, so both see the same machine state; the difference
is what the router adds (two legs, a fresh room id, SSE pass-through). At concurrency 1 it also
reports the process CPU time per request (everything runs in this process), which is less
sensitive than latency to other load on a shared machine.

    python bench/router_overhead.py --num-requests 2000 --output-len 16
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import orjson
from aiohttp import web

from pdserve.router import Router, RouterConfig


class InstantWorkerDouble:
    """Bench double of a pdserve worker: follows the HTTP contract, returns ``max_tokens``
    made-up tokens at once. Not a model, not a test fixture: only for measuring the router."""

    def __init__(self, role: str, bootstrap_port: int | None = None) -> None:
        self.role = role
        self.bootstrap_port = bootstrap_port
        self.num_requests = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health/ready", self._ok)
        app.router.add_get("/health", self._ok)
        app.router.add_get("/server_info", self._info)
        app.router.add_post("/abort/{rid}", self._ok)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _ok(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "role": self.role,
                "model": "instant",
                "engine_id": self.role,
                "incarnation": "1",
                "bootstrap_port": self.bootstrap_port,
                "max_model_len": 1 << 20,
            }
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.num_requests += 1
        rid = request.headers.get("X-Request-Id", "x")
        if not body.get("stream"):
            message = {"role": "assistant", "content": "ok"}
            choice = {"index": 0, "message": message, "finish_reason": "length"}
            return web.json_response({"id": rid, "object": "chat.completion", "choices": [choice]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(int(body.get("max_tokens", 16))):
            delta = {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}
            chunk = {"id": rid, "object": "chat.completion.chunk", "choices": [delta]}
            await out.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        return out


@dataclass(frozen=True)
class OverheadConfig:
    num_requests: int = 1000  # per mode
    output_len: int = 16
    concurrency: int = 1
    num_warmup: int = 50
    timeout_s: float = 10.0


async def _timed_request(
    session: aiohttp.ClientSession, url: str, output_len: int, timeout_s: float
) -> tuple[float, float, float]:
    """(TTFT, E2E, process CPU) in seconds of one streaming chat request."""
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "instant", "messages": messages, "max_tokens": output_len, "stream": True}
    cpu_start = time.process_time()
    start = time.perf_counter()
    ttft = None
    async with session.post(
        url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError(f"{url}: no tokens")
    return ttft, time.perf_counter() - start, time.process_time() - cpu_start


async def _measure(cfg: OverheadConfig, direct_url: str, router_url: str) -> dict[str, Any]:
    samples: dict[str, list[tuple[float, float, float]]] = {"direct": [], "router": []}
    urls = {"direct": direct_url, "router": router_url}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for mode in ("direct", "router") * cfg.num_warmup:
            await _timed_request(session, urls[mode], cfg.output_len, cfg.timeout_s)

        async def client(first: int) -> None:
            order = ("direct", "router") if first % 2 == 0 else ("router", "direct")
            for _ in range(cfg.num_requests // cfg.concurrency):
                for mode in order:  # interleaved, so drift hits both modes alike
                    t = await _timed_request(session, urls[mode], cfg.output_len, cfg.timeout_s)
                    samples[mode].append(t)

        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(cfg.concurrency)))
        duration = time.perf_counter() - started
    return _summarize(samples, duration, is_cpu_exact=cfg.concurrency == 1)


def _summarize(
    samples: dict[str, list[tuple[float, float, float]]], duration_s: float, is_cpu_exact: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {"duration_s": duration_s}
    for mode, rows in samples.items():
        arr = np.asarray(rows) * 1000.0  # ms; columns: TTFT, E2E, process CPU
        out[mode] = {
            "num_requests": len(rows),
            "ttft_p50_ms": float(np.percentile(arr[:, 0], 50)),
            "ttft_p99_ms": float(np.percentile(arr[:, 0], 99)),
            "e2e_p50_ms": float(np.percentile(arr[:, 1], 50)),
            "e2e_p99_ms": float(np.percentile(arr[:, 1], 99)),
            # Overlapping requests would share CPU windows: only exact one at a time.
            "cpu_mean_ms": float(arr[:, 2].mean()) if is_cpu_exact else float("nan"),
        }
    d, r = out["direct"], out["router"]
    out["added_ms"] = {k.replace("_ms", ""): r[k] - d[k] for k in d if k.endswith("_ms")}
    return out


async def run_overhead(cfg: OverheadConfig) -> dict[str, Any]:
    """Start the doubles and a router, measure both ways, stop everything; returns figures."""
    prefill = InstantWorkerDouble("prefill", bootstrap_port=8998)
    decode = InstantWorkerDouble("decode")
    await prefill.start()
    await decode.start()
    router = Router(RouterConfig(port=0, prefill_urls=(prefill.url,), decode_urls=(decode.url,)))
    try:
        await router.start()
        await router.health.check_all()
        if not router.workers.has_complete_path():
            raise RuntimeError("router did not see the doubles as healthy")
        result = await _measure(cfg, decode.url, router.url)
        result["num_prefill_legs"] = prefill.num_requests
        return result
    finally:
        await router.stop()
        await prefill.stop()
        await decode.stop()


def format_report(cfg: OverheadConfig, res: dict[str, Any]) -> str:
    lines = [
        f"router overhead: {cfg.num_requests} requests per mode, {cfg.output_len} tokens each, "
        f"concurrency {cfg.concurrency}",
        f"{'mode':<8}{'TTFT p50':>10}{'TTFT p99':>10}{'E2E p50':>10}{'E2E p99':>10}"
        f"{'CPU/req':>10}  (ms)",
    ]
    for mode in ("direct", "router", "added_ms"):
        row = res[mode]
        vals = [row[k] for k in row if k != "num_requests"]
        name = "added" if mode == "added_ms" else mode
        lines.append(f"{name:<8}" + "".join(f"{v:>10.3f}" for v in vals))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-requests", type=int, default=1000, help="per mode")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--num-warmup", type=int, default=50)
    p.add_argument("--json-out", default=None)
    p.add_argument("--no-uvloop", action="store_true")
    a = p.parse_args(argv)
    cfg = OverheadConfig(a.num_requests, a.output_len, a.concurrency, a.num_warmup)
    loop_factory = None
    if not a.no_uvloop:
        import uvloop  # noqa: PLC0415 - the router CLI runs on uvloop too

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        res = runner.run(run_overhead(cfg))
    print(format_report(cfg, res))
    if a.json_out:
        with open(a.json_out, "wb") as f:
            f.write(
                orjson.dumps({"config": cfg.__dict__, "result": res}, option=orjson.OPT_INDENT_2)
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
