"""Every prefill SIGKILLed under load behind a real router (2 prefills, 1 decode, default
readiness): no request fails (the decode prefills them itself, counted in
``pdserve_router_decode_fallbacks_total``), the router's ``/health/ready`` never leaves 200
(a balancer keeps it in rotation), ``/health/pd`` says the PD path is down, and the PD path
comes back by itself when one prefill is started again."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from tests.e2e.conftest import (
    Proc,
    StreamResult,
    assign_distinct_ports,
    fetch,
    get_json,
    router,
    scrape,
    stream_completion,
    wait_for,
    worker,
)

BODY = {"model": "demo", "prompt": "The fleet lost its prefills", "max_tokens": 12,
        "ignore_eos": True}  # fmt: skip
CONCURRENCY = 3
MAX_REQUESTS = 300  # bounds the load whatever happens
PHASE_TIMEOUT_S = 120.0
FALLBACKS = "pdserve_router_decode_fallbacks_total"


@dataclass
class Fleet:
    prefills: list[Proc]
    decode: Proc
    router: Proc


@pytest.fixture
def fleet(tmp_path: Path, demo_model_dir: Path) -> Iterator[Fleet]:
    prefills = [worker(tmp_path, f"prefill-{i}", "prefill", demo_model_dir) for i in range(2)]
    decode = worker(tmp_path, "decode-0", "decode", demo_model_dir)
    rt = router(tmp_path, prefills, [decode], "--connect-timeout", "1")
    procs = [*prefills, decode, rt]
    assign_distinct_ports(procs)
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()  # the router's: /health/pd, both legs of a pair are up
        yield Fleet(prefills, decode, rt)
    finally:
        for p in reversed(procs):
            p.stop()


@dataclass
class Load:
    """Streams sent ``CONCURRENCY`` at a time until ``stop``; every result kept."""

    url: str
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    results: list[StreamResult] = field(default_factory=list)
    num_sent: int = 0

    async def run(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._client(session) for _ in range(CONCURRENCY)))

    async def _client(self, session: aiohttp.ClientSession) -> None:
        while not self.stop.is_set() and self.num_sent < MAX_REQUESTS:
            self.num_sent += 1
            self.results.append(await stream_completion(session, self.url, BODY, timeout_s=90))

    @property
    def num_done(self) -> int:
        return len(self.results)


async def _watch_readiness(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> list:
    """Every /health/ready status until ``stop`` (a look each 50 ms at most)."""
    seen = []
    while not stop.is_set():
        seen.append((await fetch(session, "GET", f"{url}/health/ready", timeout_s=10))[0])
        await asyncio.sleep(0.05)  # sampling interval of the watch, not a synchronisation
    return seen


async def _status(session: aiohttp.ClientSession, url: str) -> int:
    return (await fetch(session, "GET", url, timeout_s=10))[0]


async def test_losing_every_prefill_under_load_fails_no_request_and_keeps_the_router_ready(
    fleet: Fleet,
) -> None:
    rt = fleet.router.url
    async with aiohttp.ClientSession() as s:
        for p in fleet.prefills:  # same checkpoint: both publish the decode's weights
            info = await get_json(s, f"{p.url}/server_info")
            decode_info = await get_json(s, f"{fleet.decode.url}/server_info")
            assert info["weights"] and info["weights"] == decode_info["weights"]
        load, watch_stop = Load(rt), asyncio.Event()
        watch = asyncio.create_task(_watch_readiness(s, rt, watch_stop))
        driving = asyncio.create_task(load.run(s))
        try:
            await wait_for(_async(lambda: load.num_done >= 4), PHASE_TIMEOUT_S, "PD requests")
            assert (await scrape(s, rt)).total(FALLBACKS) == 0  # all served by the PD path

            for p in fleet.prefills:
                p.kill()
            served_before = load.num_done

            async def fallback_serves() -> bool:
                fallbacks = (await scrape(s, rt)).total(FALLBACKS)
                return fallbacks >= 4 and load.num_done >= served_before + 4

            await wait_for(fallback_serves, PHASE_TIMEOUT_S, "requests served by the decode")
            assert await _status(s, f"{rt}/health/pd") == 503
            assert await _status(s, f"{rt}/health/ready") == 200

            back = fleet.prefills[0]
            back.start()
            back.wait_ready()

            async def pd_path_back() -> bool:
                return await _status(s, f"{rt}/health/pd") == 200

            await wait_for(pd_path_back, PHASE_TIMEOUT_S, "the PD path back")

            async def prefill_serves() -> bool:
                m = await scrape(s, back.url)
                return m.total("pdserve_prefix_cache_queries_total", role="prefill") >= 3

            await wait_for(prefill_serves, PHASE_TIMEOUT_S, "the returned prefill serving")
        finally:
            load.stop.set()
            await driving
            watch_stop.set()
            statuses = await watch

    failed = [r for r in load.results if not r.is_complete]
    assert failed == [], failed[:3]
    assert load.num_sent < MAX_REQUESTS  # the phases ended by their conditions
    assert statuses and set(statuses) == {200}, statuses
    for proc in (fleet.decode, fleet.router):
        assert "Traceback" not in proc.log_text(), proc.log_tail()


def _async(check):  # a plain predicate as wait_for's awaitable check
    async def run() -> bool:
        return check()

    return run
