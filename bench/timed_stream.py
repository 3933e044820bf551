"""A streamed completion timed token by token, for benches that measure inter-token gaps
(bench/reuse_compare.py's long_prompt): each text chunk's arrival time, and the gaps that
overlap a window (another request's prefill)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import orjson


@dataclass
class Stream:
    """One streamed completion: the arrival time of each SSE chunk that carries text."""

    sent_at: float = 0.0
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
    is_done: bool = False  # its response ended (or failed)


def has_outlasted(until: Stream, now: float) -> bool:
    """``until`` got its first token before ``now``, or ended without one."""
    return until.is_done or bool(until.token_times and until.token_times[0] < now)


async def stream(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, out: Stream,
    on_token: asyncio.Event | None, timeout_s: float, until: Stream | None = None,
    min_tokens: int = 0,
) -> None:  # fmt: skip
    """POST a streamed completion; ``on_token`` is set at its second token (or its end).

    With ``until``, the client hangs up (the worker aborts it) at its first token, after
    ``min_tokens``, that arrives once ``until`` has its first token: a stream that must still
    run during another request's prefill does, whatever the machine's speed (its
    ``max_tokens`` is then only a bound)."""
    payload = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
               "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    out.sent_at = time.perf_counter()
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(f"{url}/v1/completions", json=payload, timeout=timeout) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for line in resp.content:
                now = time.perf_counter()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                obj = orjson.loads(line[5:].strip())
                if "error" in obj:
                    out.error = str(obj["error"])[:200]
                    return
                if any(c.get("text") for c in obj.get("choices") or ()):
                    out.token_times.append(now)
                    if on_token is not None and len(out.token_times) == 2:
                        on_token.set()
                    if (
                        until is not None
                        and len(out.token_times) >= min_tokens
                        and has_outlasted(until, now)
                    ):
                        return  # leaving the block closes the connection: the worker aborts
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        out.is_done = True
        if on_token is not None:
            on_token.set()  # ended (or failed) early: nobody waits for its second token


def window_itls(streams: list[Stream], lo: float, hi: float) -> list[float]:
    """The streams' inter-token gaps that overlap ``(lo, hi)``: a stall across it counts."""
    gaps = []
    for s in streams:
        t = np.asarray(s.token_times)
        if len(t) > 1:
            a, b = t[:-1], t[1:]
            gaps += (b - a)[(b > lo) & (a < hi)].tolist()
    return gaps


def pct_ms(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values) * 1000.0, q)) if values else None
