"""Drains on a real subprocess PD cluster: SIGTERM with requests in flight, requests arriving
during a drain, and a rolling restart of every worker under a bounded load.

One module cluster (2 prefills, 2 decodes, a router probing every 0.5 s). Every test leaves the
cluster whole again (a drained worker exits 0 and is started again on its ports).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.e2e.conftest import (
    Proc,
    StreamResult,
    assign_distinct_ports,
    ensure_whole,
    fetch,
    get_json,
    router,
    stream_completion,
    wait_for,
    wait_idle,
    worker,
)

DRAIN_TIMEOUT_S = 30.0
LONG = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
SHORT = {"model": "demo", "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}


@dataclass
class DrainCluster:
    prefills: list[Proc]
    decodes: list[Proc]
    router: Proc

    @property
    def workers(self) -> list[tuple[Proc, str]]:
        return [(p, "prefill") for p in self.prefills] + [(d, "decode") for d in self.decodes]


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path
) -> Iterator[DrainCluster]:
    tmp = tmp_path_factory.mktemp("drain")
    drain = ("--drain-timeout", str(DRAIN_TIMEOUT_S))
    prefills = [worker(tmp, f"prefill-{i}", "prefill", demo_model_dir, *drain) for i in range(2)]
    decodes = [worker(tmp, f"decode-{i}", "decode", demo_model_dir, *drain) for i in range(2)]
    rt = router(tmp, prefills, decodes, "--connect-timeout", "1", "--request-timeout", "90",
                "--max-attempts", "4")  # fmt: skip
    assign_distinct_ports([*prefills, *decodes, rt])
    c = DrainCluster(prefills, decodes, rt)
    procs = [*prefills, *decodes, rt]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()
        yield c
    finally:
        for p in reversed(procs):
            p.stop()


async def _whole(s: aiohttp.ClientSession, c: DrainCluster) -> None:
    """Every worker running and seen healthy (breaker not open) by the router."""
    await ensure_whole(s, [p for p, _ in c.workers], c.router.url)


def _sigterm(proc: Proc) -> None:
    assert proc.proc is not None
    os.killpg(proc.proc.pid, signal.SIGTERM)


async def _exit_code(proc: Proc, timeout_s: float = DRAIN_TIMEOUT_S + 15) -> int:
    assert proc.proc is not None
    return await asyncio.to_thread(proc.proc.wait, timeout_s)


async def _running(s: aiohttp.ClientSession, proc: Proc) -> int:
    return len((await get_json(s, f"{proc.url}/debug/requests"))["data"])


async def _no_traceback(proc: Proc) -> None:
    assert "Traceback" not in proc.log_text(), proc.log_tail()


async def _restart(s: aiohttp.ClientSession, c: DrainCluster, proc: Proc) -> None:
    await asyncio.to_thread(proc.start().wait_ready)
    incarnation = (await get_json(s, f"{proc.url}/server_info"))["incarnation"]

    async def router_has_it() -> bool:
        data = (await get_json(s, f"{c.router.url}/workers"))["data"]
        return any(
            w["url"] == proc.url and w["incarnation"] == incarnation and w["state"] == "healthy"
            for w in data
        )

    await wait_for(router_has_it, 20, f"router sees {proc.name} again")


async def test_sigterm_lets_streams_in_flight_finish_and_turns_new_requests_away(
    cluster: DrainCluster,
) -> None:
    async with aiohttp.ClientSession() as s:
        await _whole(s, cluster)
        target = cluster.decodes[0]
        streams = [
            asyncio.create_task(stream_completion(s, cluster.router.url, LONG, timeout_s=120))
            for _ in range(4)
        ]

        async def target_busy() -> bool:
            return await _running(s, target) > 0

        await wait_for(target_busy, 30, f"a stream running on {target.name}")
        _sigterm(target)

        async def turned_away() -> tuple[int, bytes, str | None]:
            async with s.post(f"{target.url}/v1/completions", json=SHORT) as resp:
                return resp.status, await resp.read(), resp.headers.get("Retry-After")

        status, body, retry_after = await wait_for(
            lambda: _first_status(turned_away, 503), 10, "the draining decode answers 503"
        )
        error = orjson.loads(body)["error"]
        assert (error["type"], error["code"]) == ("draining", "draining")
        assert retry_after is not None and int(retry_after) > 0
        assert (await fetch(s, "GET", f"{target.url}/health/ready"))[0] == 503
        assert (await fetch(s, "GET", f"{target.url}/health"))[0] == 200
        results: list[StreamResult] = list(await asyncio.gather(*streams))
        for r in results:
            assert _served_in_full(r), r
        assert await _exit_code(target) == 0
        await _no_traceback(target)
        await _restart(s, cluster, target)
        for p, role in cluster.workers:
            await wait_idle(s, p, role)


def _served_in_full(r: StreamResult) -> bool:
    """Ended normally after its whole budget (ignore_eos: "length"), with tokens, no error."""
    return r.is_complete and r.finish_reason == "length" and r.num_tokens > 0 and r.error is None


async def _first_status(call, status: int):  # type: ignore[no-untyped-def]
    got = await call()
    return got if got[0] == status else None


async def test_a_prefill_drained_while_requests_arrive_loses_none(cluster: DrainCluster) -> None:
    async with aiohttp.ClientSession() as s:
        await _whole(s, cluster)
        target = cluster.prefills[0]
        streams = [
            asyncio.create_task(stream_completion(s, cluster.router.url, SHORT, timeout_s=90))
            for _ in range(8)
        ]
        _sigterm(target)  # some prefills are in flight on it, some arrive during its drain
        more = [
            asyncio.create_task(stream_completion(s, cluster.router.url, SHORT, timeout_s=90))
            for _ in range(8)
        ]
        results: list[StreamResult] = list(await asyncio.gather(*streams, *more))
        for r in results:
            assert _served_in_full(r), r
        assert await _exit_code(target) == 0
        await _no_traceback(target)
        await _restart(s, cluster, target)
        for p, role in cluster.workers:
            await wait_idle(s, p, role)


async def test_a_rolling_restart_of_every_worker_under_load_loses_no_request(
    cluster: DrainCluster,
) -> None:
    async with aiohttp.ClientSession() as s:
        await _whole(s, cluster)
        stop = asyncio.Event()
        results: list[StreamResult] = []
        deadline = time.monotonic() + 240  # the load is bounded in time and in count

        async def client() -> None:
            for _ in range(200):
                if stop.is_set() or time.monotonic() > deadline:
                    return
                results.append(await stream_completion(s, cluster.router.url, SHORT, timeout_s=90))

        clients = [asyncio.create_task(client()) for _ in range(3)]
        for proc, _role in cluster.workers:
            _sigterm(proc)
            assert await _exit_code(proc) == 0, proc.log_tail()
            await _restart(s, cluster, proc)
        stop.set()
        await asyncio.gather(*clients)
        failed = [r for r in results if not _served_in_full(r)]
        assert results and not failed, failed[:5]
        for p, role in cluster.workers:
            await _no_traceback(p)
            await wait_idle(s, p, role)
