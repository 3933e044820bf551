"""Serving benchmark for any OpenAI-compatible endpoint (pdserve router, a worker, vLLM, ...).

Random-word prompts of a given length, Poisson arrivals (--request-rate) and/or a concurrency
cap (--concurrency); streams every request with aiohttp and timestamps each SSE event as it
arrives. Reports TTFT, ITL, TPOT, E2E (mean, p50/p90/p99), throughput and goodput under SLOs;
writes JSON and a PNG of latency CDFs. Importable: ``await run_benchmark(BenchConfig(...))``.

    python bench/serving.py --base-url http://127.0.0.1:30000 --model demo \\
        --input-len 128 --output-len 128 --concurrency 8 --num-requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import math
import ssl
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from anywhere

from bench import workloads  # noqa: E402
from bench.sse import choice_text, sse_events  # noqa: E402
from bench.workloads import Prompt  # noqa: E402
from pdserve.cli_common import run_async  # noqa: E402


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str
    endpoint: str = "chat"  # "chat" | "completions"
    input_len: int = 128  # words, or tokens when ``tokenizer`` is given (the unique part)
    dataset: str = "random"  # see bench/workloads.py
    num_prefixes: int = 16  # prefix_repetition: groups ...
    prefix_len: int = 1024  # ... and their shared prefix length
    num_turns: int = 4  # multi_turn: user turns per conversation
    output_len: int = 128
    num_requests: int = 64
    request_rate: float = math.inf  # Poisson arrivals per second; inf = all at once
    concurrency: int | None = None  # max requests in flight; None = no cap
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    api_key: str | None = None
    ca_certs: str | None = None  # an https base_url: verify the server against this CA bundle
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0  # per request
    max_duration_s: float = 3600.0  # the whole run; unfinished requests count as errors
    num_warmup: int = 1
    tokenizer: str | None = None  # a tokenizer.json (or its folder) for exact input lengths
    json_out: str | None = None
    png_out: str | None = None
    is_progress_shown: bool = True
    # A new connection per request, as vLLM's `bench serve` client opens one: llama-server
    # drops a kept-alive connection that follows a streamed response ("Can not write request
    # body" on the next request).
    is_connection_closed: bool = False


@dataclass
class RequestResult:
    is_ok: bool = False
    error: str | None = None
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    num_output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


def make_prompts(cfg: BenchConfig) -> list[Prompt]:
    """The run's prompts (bench/workloads.py), deterministic in ``seed``."""
    return workloads.make_prompts(
        cfg.dataset, cfg.num_requests, cfg.input_len, seed=cfg.seed, tokenizer=cfg.tokenizer,
        num_prefixes=cfg.num_prefixes, prefix_len=cfg.prefix_len, num_turns=cfg.num_turns,
        output_len=cfg.output_len,
    )  # fmt: skip


def build_payload(cfg: BenchConfig, prompt: Prompt) -> tuple[str, dict[str, Any]]:
    payload: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": cfg.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        payload["ignore_eos"] = True  # so every output has the asked length
    if cfg.endpoint == "chat":
        is_text = isinstance(prompt, str)
        payload["messages"] = [{"role": "user", "content": prompt}] if is_text else prompt
        return "/v1/chat/completions", payload
    if not isinstance(prompt, str):
        raise ValueError("multi_turn prompts are chat messages: use --endpoint chat")
    payload["prompt"] = prompt
    return "/v1/completions", payload


async def send_request(
    session: aiohttp.ClientSession, cfg: BenchConfig, prompt: Prompt
) -> RequestResult:
    """One streamed request; event times are taken when each SSE line arrives."""
    path, payload = build_payload(cfg, prompt)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    result = RequestResult()
    start = time.perf_counter()
    try:
        async with session.post(
            cfg.base_url.rstrip("/") + path,
            json=payload,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
        ) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            num_events = await _read_events(resp, result, start)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    if result.error is None:
        result.e2e_s = result.e2e_s or time.perf_counter() - start
        result.num_output_tokens = result.num_output_tokens or num_events
        result.is_ok = result.ttft_s is not None
        result.error = None if result.is_ok else "no tokens received"
    return result


async def _read_events(resp: aiohttp.ClientResponse, result: RequestResult, start: float) -> int:
    """Fill TTFT/ITL/usage from the SSE stream; returns the number of events with text."""
    num_events = 0
    last = start
    async for event in sse_events(resp):
        now, obj = event.at, event.data
        if obj is None:  # [DONE]: read on to the end of the body, so the server sees a clean finish
            result.e2e_s = now - start
            continue
        if "error" in obj:
            result.error = str(obj["error"])[:200]
            break
        if usage := obj.get("usage"):
            result.num_prompt_tokens = usage.get("prompt_tokens")
            result.num_output_tokens = usage.get("completion_tokens") or 0
            details = usage.get("prompt_tokens_details") or {}
            result.num_cached_tokens = details.get("cached_tokens")
        if any(choice_text(c) for c in obj.get("choices") or ()):
            if num_events == 0:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            num_events += 1
            last = now
    return num_events


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, is_enabled: bool) -> None:
        self.total, self.is_enabled = total, is_enabled
        self.num_ok = self.num_err = 0
        self.started = time.perf_counter()

    def update(self, result: RequestResult) -> None:
        if result.is_ok:
            self.num_ok += 1
        else:
            self.num_err += 1
        if self.is_enabled:
            done = self.num_ok + self.num_err
            bar = "#" * (30 * done // self.total)
            elapsed = time.perf_counter() - self.started
            sys.stderr.write(
                f"\r[{bar:<30}] {done}/{self.total} ok={self.num_ok} err={self.num_err} "
                f"{elapsed:.1f}s"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.is_enabled:
            sys.stderr.write("\n")


async def _drive(cfg: BenchConfig, prompts: list[Prompt], session: aiohttp.ClientSession) -> Any:
    rng = np.random.default_rng(cfg.seed)
    limit = asyncio.Semaphore(cfg.concurrency or len(prompts))
    progress = Progress(len(prompts), cfg.is_progress_shown)
    results: list[RequestResult] = [RequestResult(error="not finished") for _ in prompts]

    async def one(i: int) -> None:
        async with limit:
            results[i] = await send_request(session, cfg, prompts[i])
        progress.update(results[i])

    tasks = []
    start = time.perf_counter()
    next_at = 0.0
    for i in range(len(prompts)):
        if math.isfinite(cfg.request_rate):
            next_at += rng.exponential(1.0 / cfg.request_rate)
            await asyncio.sleep(max(0.0, start + next_at - time.perf_counter()))  # pacing
        tasks.append(asyncio.create_task(one(i)))
    time_left = start + cfg.max_duration_s - time.perf_counter()
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, time_left))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - start
    progress.close()
    return results, duration


async def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Run the benchmark; returns the summary (also written to json_out/png_out if set)."""
    if cfg.endpoint not in ("chat", "completions"):
        raise ValueError("endpoint must be 'chat' or 'completions'")
    prompts = make_prompts(cfg)
    ssl_ctx = ssl.create_default_context(cafile=cfg.ca_certs) if cfg.ca_certs else True
    connector = aiohttp.TCPConnector(limit=0, force_close=cfg.is_connection_closed, ssl=ssl_ctx)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(cfg.num_warmup):
            warm = await send_request(session, cfg, prompts[0])
            if not warm.is_ok:
                raise RuntimeError(f"warmup request failed: {warm.error}")
        results, duration = await _drive(cfg, prompts, session)
    summary = summarize(cfg, results, duration)
    write_outputs(cfg, summary, results)
    return summary


def write_outputs(cfg: BenchConfig, summary: dict[str, Any], results: list[RequestResult]) -> None:
    if cfg.json_out:
        out = {"config": asdict(cfg), "summary": summary, "requests": [_row(r) for r in results]}
        Path(cfg.json_out).write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    if cfg.png_out:
        plot_cdfs(results, cfg.png_out, title=f"{cfg.base_url} {cfg.endpoint}")


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values) * 1000.0
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(cfg: BenchConfig, results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.is_ok]
    num_out = sum(r.num_output_tokens for r in ok)
    num_in = sum(r.num_prompt_tokens or 0 for r in ok)
    num_cached = sum(r.num_cached_tokens or 0 for r in ok)
    reports_cached = any(r.num_cached_tokens is not None for r in ok)
    good = [r for r in ok if _meets_slo(cfg, r)]
    errors = [r.error for r in results if not r.is_ok]
    duration_s = max(duration_s, 1e-9)
    return {
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_errors": len(errors),
        "first_errors": errors[:5],
        "duration_s": duration_s,
        "mean_input_tokens": num_in / len(ok) if ok else None,
        "mean_output_tokens": num_out / len(ok) if ok else None,
        # Prompt tokens the server found in its prefix cache (None: it does not say).
        "prefix_cache_hit_rate": num_cached / num_in if reports_cached and num_in else None,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": num_out / duration_s,
        "total_token_throughput": (num_in + num_out) / duration_s,
        "goodput": len(good) / duration_s,
        "num_good": len(good),
        "ttft_ms": _stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
    }


def _meets_slo(cfg: BenchConfig, r: RequestResult) -> bool:
    if cfg.slo_ttft_ms is not None and (r.ttft_s or 0) * 1000 > cfg.slo_ttft_ms:
        return False
    tpot = r.tpot_s
    return cfg.slo_tpot_ms is None or tpot is None or tpot * 1000 <= cfg.slo_tpot_ms


def _row(r: RequestResult) -> dict[str, Any]:
    return {
        "ok": r.is_ok,
        "error": r.error,
        "prompt_tokens": r.num_prompt_tokens,
        "cached_tokens": r.num_cached_tokens,
        "output_tokens": r.num_output_tokens,
        "ttft_s": r.ttft_s,
        "tpot_s": r.tpot_s,
        "e2e_s": r.e2e_s,
        "itl_s": r.itl_s,
    }


def format_table(summary: dict[str, Any]) -> str:
    s = summary
    lines = [
        f"requests: {s['num_completed']}/{s['num_requests']} ok, {s['num_errors']} errors, "
        f"{s['duration_s']:.2f} s",
        f"mean tokens: in {s['mean_input_tokens']}, out {s['mean_output_tokens']}; prefix cache "
        f"hit rate {s['prefix_cache_hit_rate']}",
        f"throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} out tok/s,"
        f" {s['total_token_throughput']:.1f} total tok/s; goodput {s['goodput']:.2f} req/s",
        f"{'metric':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}  (ms)",
    ]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        row = s[name]
        cells = "".join(f"{v:>10.2f}" if v is not None else f"{'-':>10}" for v in row.values())
        lines.append(f"{name[:-3].upper():<8}{cells}")
    return "\n".join(lines)


def plot_cdfs(results: list[RequestResult], path: str, title: str = "") -> None:
    import matplotlib  # noqa: PLC0415 - optional, only for the PNG

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    ok = [r for r in results if r.is_ok]
    series = {
        "TTFT": [r.ttft_s for r in ok if r.ttft_s is not None],
        "TPOT": [t for r in ok if (t := r.tpot_s) is not None],
        "ITL": [x for r in ok for x in r.itl_s],
        "E2E": [r.e2e_s for r in ok if r.e2e_s is not None],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series.items(), strict=True):
        if values:
            xs = np.sort(np.asarray(values) * 1000.0)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--input-len", type=int, default=128, help="unique words (tokens) per prompt")
    p.add_argument("--dataset", choices=workloads.DATASETS, default="random")
    p.add_argument("--num-prefixes", type=int, default=16, help="prefix_repetition groups")
    p.add_argument("--prefix-len", type=int, default=1024, help="prefix_repetition prefix")
    p.add_argument("--num-turns", type=int, default=4, help="multi_turn turns")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson req/s")
    p.add_argument("--concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-ignore-eos", action="store_true", help="for servers without ignore_eos")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--max-duration", type=float, default=3600.0, help="whole run, seconds")
    p.add_argument("--num-warmup", type=int, default=1)
    p.add_argument("--tokenizer", default=None, help="tokenizer.json for exact input lengths")
    p.add_argument("--json-out", default=None)
    p.add_argument("--png-out", default=None)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    return BenchConfig(
        base_url=a.base_url, model=a.model, endpoint=a.endpoint, input_len=a.input_len,
        dataset=a.dataset, num_prefixes=a.num_prefixes, prefix_len=a.prefix_len,
        num_turns=a.num_turns,
        output_len=a.output_len, num_requests=a.num_requests, request_rate=a.request_rate,
        concurrency=a.concurrency, seed=a.seed, slo_ttft_ms=a.slo_ttft_ms,
        slo_tpot_ms=a.slo_tpot_ms, api_key=a.api_key, ignore_eos=not a.no_ignore_eos,
        temperature=a.temperature, timeout_s=a.timeout, max_duration_s=a.max_duration,
        num_warmup=a.num_warmup, tokenizer=a.tokenizer, json_out=a.json_out,
        png_out=a.png_out, is_progress_shown=not a.no_progress,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    summary = run_async(run_benchmark(cfg))
    print(format_table(summary))
    return 0 if summary["num_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
