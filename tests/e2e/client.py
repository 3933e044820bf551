"""What the end-to-end tests ask of live servers over HTTP: calls, /metrics scrapes, polling
with deadlines, idleness (every queue gauge exactly 0) and streamed completions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench.sse import SseEvent, sse_events
from tests.e2e.procs import Proc

QUEUE_GAUGES = (
    "pdserve_waiting_requests",
    "pdserve_running_requests",
    "pdserve_prefill_inflight_requests",
    "pdserve_decode_waiting_for_kv_requests",
)


@dataclass
class Metrics:
    """One parsed /metrics scrape: samples by name, plus the declared family names."""

    samples: dict[str, list[tuple[dict[str, str], float]]]
    families: set[str]

    def get(self, name: str, **labels: str) -> float | None:
        """The value of the one sample of ``name`` whose labels include ``labels``."""
        found = [v for lab, v in self.samples.get(name, []) if labels.items() <= lab.items()]
        assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
        return found[0] if found else None

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
        return sum(v for lab, v in self.samples.get(name, []) if labels.items() <= lab.items())

    def by_label(self, name: str, label: str) -> dict[str, float]:
        return {lab[label]: v for lab, v in self.samples.get(name, []) if label in lab}


def parse_metrics(text: str) -> Metrics:
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    families: set[str] = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), s.value))
    return Metrics(samples, families)


async def fetch(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> tuple[int, bytes]:
    """One HTTP call on an aiohttp session: (status, body) whatever the status.

    ``body``: bytes are sent as they are, anything else as JSON.
    """
    data = body if isinstance(body, bytes | None) else orjson.dumps(body)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.request(method, url, data=data, headers=hdrs, timeout=timeout) as resp:
        return resp.status, await resp.read()


async def get_json(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> Any:
    status, raw = await fetch(session, "GET", url, headers=headers, timeout_s=10)
    assert status == 200, f"GET {url} -> {status}: {raw[:300]!r}"
    return orjson.loads(raw)


async def scrape(session: aiohttp.ClientSession, url: str) -> Metrics:
    status, raw = await fetch(session, "GET", f"{url}/metrics", timeout_s=10)
    assert status == 200, f"GET {url}/metrics -> {status}"
    return parse_metrics(raw.decode())


async def wait_for(
    check: Callable[[], Awaitable[Any]], timeout_s: float, what: str, interval_s: float = 0.05
) -> Any:
    """Poll ``check`` until it returns a truthy value (returned); AssertionError past the deadline.

    Exceptions from ``check`` (a server not answering yet) count as "not yet".
    """
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = await check()
        except (OSError, AssertionError, TimeoutError) as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last: {last}")
        await asyncio.sleep(interval_s)  # poll with a deadline


async def wait_router_sees_every_worker(
    session: aiohttp.ClientSession, router_url: str, timeout_s: float = 60.0
) -> None:
    """Until the router lists every worker healthy with its breaker not open (a half-open one
    closes with the next request it is given): a router is ready once one pair is."""

    async def usable() -> bool:
        data = (await get_json(session, f"{router_url}/workers"))["data"]
        assert all(w["state"] == "healthy" and w["breaker"] != "open" for w in data), data
        return True

    await wait_for(usable, timeout_s, "router sees every worker healthy")


async def ensure_whole(session: aiohttp.ClientSession, procs: list[Proc], router_url: str) -> None:
    """Restart whatever an earlier (failed) test left dead, then wait until the router sees all."""
    for p in procs:
        assert p.proc is not None
        if p.proc.poll() is not None:
            await asyncio.to_thread(p.start().wait_ready)
    await wait_router_sees_every_worker(session, router_url)


async def idle_problems(
    session: Any, proc: Proc, role: str, headers: dict[str, str] | None = None
) -> list[str]:
    """What keeps a worker from being idle: queue gauges, room gauges, ages, pages, /debug."""
    m = await scrape(session, proc.url)
    problems = [f"{g}={m.get(g, role=role)}" for g in QUEUE_GAUGES if m.get(g, role=role) != 0]
    problems += [f"rooms[{s}]={n}" for s, n in m.by_label("pdserve_rooms", "state").items() if n]
    ages = m.by_label("pdserve_oldest_nonterminal_age_seconds", "state")
    problems += [f"oldest_age[{s}]={a}" for s, a in ages.items() if a != 0]
    total, free = m.get("pdserve_kv_pages_total", role=role), m.get("pdserve_kv_pages_free")
    cached = m.get("pdserve_kv_pages_cached", role=role)
    if total != free + cached:
        problems.append(f"pages free {free} + cached {cached} of {total}")
    for kind in ("rooms", "requests"):
        data = (await get_json(session, f"{proc.url}/debug/{kind}", headers))["data"]
        if data:
            problems.append(f"/debug/{kind}: {data}")
    return problems


async def wait_idle(
    session: aiohttp.ClientSession,
    proc: Proc,
    role: str,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> None:
    """Wait until ``proc`` shows exactly zero live work (see :func:`idle_problems`)."""

    async def is_idle() -> bool:
        problems = await idle_problems(session, proc, role, headers)
        assert not problems, f"{proc.name}: {problems}"
        return True

    await wait_for(is_idle, timeout_s, f"{proc.name} idle")


@dataclass
class StreamResult:
    """How one streamed completion ended, as the client saw it."""

    status: int | None = None
    num_tokens: int = 0  # text deltas received
    finish_reason: str | None = None
    error: Any = None  # an SSE error event, or the JSON error body of a non-200 answer
    saw_done: bool = False
    exception: str | None = None  # the connection broke (no [DONE])
    elapsed_s: float = 0.0

    @property
    def is_complete(self) -> bool:
        return self.status == 200 and self.finish_reason is not None and self.saw_done

    @property
    def is_clean_error(self) -> bool:
        """Ended with an error the client can read: an error status, or error event + [DONE]."""
        if self.status is not None and self.status >= 400:
            return self.error is not None
        return self.error is not None and self.saw_done


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    first_event: Any = None,
) -> StreamResult:
    """POST a streaming /v1/completions and read it to its end; never raises for server trouble.

    ``first_event`` (an asyncio.Event) is set once the first data event arrived.
    """
    res = StreamResult()
    started = time.monotonic()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        async with session.post(
            f"{url}/v1/completions",
            data=orjson.dumps({**body, "stream": True}),
            headers=hdrs,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = orjson.loads(await resp.read())
                return res
            async for event in sse_events(resp):
                _on_event(res, event, first_event)
    except (aiohttp.ClientError, TimeoutError) as exc:
        res.exception = f"{type(exc).__name__}: {exc}"
    finally:
        res.elapsed_s = time.monotonic() - started
    return res


def _on_event(res: StreamResult, event: SseEvent, first_event: Any) -> None:
    if first_event is not None:
        first_event.set()
    if event.data is None:
        res.saw_done = True
        return
    if "error" in event.data:
        res.error = event.data["error"]
        return
    for choice in event.data.get("choices", []):
        if choice.get("text"):
            res.num_tokens += 1
        res.finish_reason = choice.get("finish_reason") or res.finish_reason
