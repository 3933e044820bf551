"""Peers dying and coming back: SIGKILL under load, restarts as new incarnations, any start order.

One module cluster (2 prefills, 2 decodes, a router; heartbeats every 0.5 s). Each test kills
one process, checks what the survivors do, restarts it on the same port and leaves the cluster
whole again. Rooms that only a peer loss can end are made on purpose by sending a request to a
decode worker alone, with kv_transfer_params naming a prefill that never gets the request.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.e2e.conftest import (
    Proc,
    StreamResult,
    assign_distinct_ports,
    ensure_whole,
    fetch,
    free_port,
    get_json,
    idle_problems,
    router,
    scrape,
    stream_completion,
    wait_for,
    wait_idle,
    worker,
)

HEARTBEAT_S = 0.5  # tests/e2e/procs.py WORKER_ARGS
LOST_AFTER_S = 2 * HEARTBEAT_S  # a peer silent this long is declared lost
SLACK_S = 2.0  # a loaded 2-core machine
CONNECT_TIMEOUT_S = 2.0  # TransportConfig.connect_timeout_s: refused connections -> bootstrap_error
STREAM = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True}
SHORT = {"model": "demo", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}


@dataclass
class Restartable:
    prefills: list[Proc]
    decodes: list[Proc]
    router: Proc
    start_order_log: dict[str, Any] = field(default_factory=dict)

    @property
    def workers(self) -> list[tuple[Proc, str]]:
        return [(p, "prefill") for p in self.prefills] + [(d, "decode") for d in self.decodes]


def _status(url: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
    data = None if body is None else orjson.dumps(body)
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _poll(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except OSError:  # not listening yet
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)  # poll with a deadline


def _router_sees(rt: Proc, role: str, count: int) -> bool:
    workers = orjson.loads(_status(f"{rt.url}/workers")[1])["data"]
    return sum(w["role"] == role and w["state"] == "healthy" for w in workers) == count


def _start_in_order(c: Restartable) -> None:
    """Router first, then the decodes, then the prefills; record what the router said meanwhile."""
    log, rt = c.start_order_log, c.router
    rt.start()
    _poll(lambda: _status(f"{rt.url}/health")[0] == 200, 60, "router alive")
    log["ready_alone"] = _status(f"{rt.url}/health/ready")[0]
    log["request_alone"] = _status(f"{rt.url}/v1/completions", SHORT)
    for d in c.decodes:
        d.start()
    for d in c.decodes:
        d.wait_ready()
    _poll(lambda: _router_sees(rt, "decode", len(c.decodes)), 30, "router sees the decodes")
    log["ready_without_prefill"] = _status(f"{rt.url}/health/ready")[0]
    log["request_without_prefill"] = _status(f"{rt.url}/v1/completions", SHORT)
    for p in c.prefills:
        p.start()
    for p in c.prefills:
        p.wait_ready()
    started = time.monotonic()
    rt.wait_ready()
    log["router_ready_after_s"] = time.monotonic() - started


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path
) -> Iterator[Restartable]:
    tmp = tmp_path_factory.mktemp("restarts")
    prefills = [worker(tmp, f"prefill-{i}", "prefill", demo_model_dir) for i in range(2)]
    decodes = [worker(tmp, f"decode-{i}", "decode", demo_model_dir) for i in range(2)]
    # These tests check how requests fail when a peer dies: no migration, no decode fallback
    # (tests/e2e/test_migration.py covers those).
    rt = router(tmp, prefills, decodes, "--connect-timeout", "1", "--request-timeout", "60",
                "--migration-limit", "0", "--enforce-disagg")  # fmt: skip
    assign_distinct_ports([*prefills, *decodes, rt])
    c = Restartable(prefills, decodes, rt)
    try:
        _start_in_order(c)
        yield c
    finally:
        for p in [rt, *decodes, *prefills]:
            p.stop()


async def _ensure_whole(s: aiohttp.ClientSession, c: Restartable) -> None:
    await ensure_whole(s, [*c.prefills, *c.decodes, c.router], c.router.url)


async def _restart(
    s: aiohttp.ClientSession, c: Restartable, proc: Proc, role: str, old: str
) -> str:
    """Start ``proc`` again on its port (idle from the start); returns its new incarnation once
    the router saw it."""
    await asyncio.to_thread(proc.start().wait_ready)
    new = (await get_json(s, f"{proc.url}/server_info"))["incarnation"]
    assert new != old
    assert not await idle_problems(s, proc, role)

    async def router_has_new() -> bool:
        data = (await get_json(s, f"{c.router.url}/workers"))["data"]
        return any(w["url"] == proc.url and w["incarnation"] == new for w in data)

    await wait_for(router_has_new, 15, f"router sees {proc.name} as {new}")
    return new


async def _decode_only(
    s: aiohttp.ClientSession, decode: Proc, host: str, port: int, room_id: str
) -> tuple[int | None, Any, float]:
    """A request on a decode worker alone: (status, body or exception, seconds)."""
    kv = {"room_id": room_id, "bootstrap_host": host, "bootstrap_port": port}
    body = {**SHORT, "kv_transfer_params": kv}
    started = time.monotonic()
    try:
        status, raw = await fetch(s, "POST", f"{decode.url}/v1/completions", body, timeout_s=90)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return None, repr(exc), time.monotonic() - started
    return status, orjson.loads(raw), time.monotonic() - started


async def _bootstrap_port(s: aiohttp.ClientSession, prefill: Proc) -> int:
    return (await get_json(s, f"{prefill.url}/server_info"))["bootstrap_port"]


async def _room_on(s: aiohttp.ClientSession, proc: Proc, room_id: str) -> dict[str, Any] | None:
    rooms = (await get_json(s, f"{proc.url}/debug/rooms"))["data"]
    return next((r for r in rooms if r["id"] == room_id), None)


async def _running_on(s: aiohttp.ClientSession, proc: Proc) -> int:
    reqs = (await get_json(s, f"{proc.url}/debug/requests"))["data"]
    return sum(r["state"] == "running" for r in reqs)


async def _num_served(s: aiohttp.ClientSession, proc: Proc, role: str) -> float:
    return (await scrape(s, proc.url)).total("pdserve_requests_total", role=role, status="length")


async def _short_requests(s: aiohttp.ClientSession, url: str, n: int) -> list[int]:
    async def one() -> int:
        return (await fetch(s, "POST", f"{url}/v1/completions", SHORT, timeout_s=60))[0]

    return list(await asyncio.gather(*(one() for _ in range(n))))


async def _serves_through(s: aiohttp.ClientSession, c: Restartable, proc: Proc, role: str) -> None:
    """Requests through the router succeed, and some of them reach ``proc``."""
    before = await _num_served(s, proc, role)
    for _ in range(5):  # round robin: a few requests are enough to come by every worker
        assert await _short_requests(s, c.router.url, 4) == [200] * 4
        if await _num_served(s, proc, role) > before:
            return
    raise AssertionError(f"no request reached {proc.name}")


async def _serves_without(
    s: aiohttp.ClientSession, c: Restartable, dead: Proc, alive: Proc, role: str
) -> None:
    """The router takes ``dead`` out; requests succeed, all through ``alive``."""

    async def dropped() -> bool:
        data = (await get_json(s, f"{c.router.url}/workers"))["data"]
        return any(w["url"] == dead.url and w["state"] == "unhealthy" for w in data)

    await wait_for(dropped, 10, f"router marks {dead.name} unhealthy")
    served = await _num_served(s, alive, role)
    assert await _short_requests(s, c.router.url, 6) == [200] * 6
    assert await _num_served(s, alive, role) >= served + 6


async def _comes_back(
    s: aiohttp.ClientSession, c: Restartable, proc: Proc, role: str, old: str
) -> None:
    """Restart ``proc`` (no action anywhere else): it serves again, and all ends idle."""
    await _restart(s, c, proc, role, old)
    await _serves_through(s, c, proc, role)
    for p, r in c.workers:
        await wait_idle(s, p, r)


def _streams(s: aiohttp.ClientSession, url: str, n: int) -> list[asyncio.Task[StreamResult]]:
    return [asyncio.create_task(stream_completion(s, url, STREAM, timeout_s=90)) for _ in range(n)]


def _assert_all_ended(results: list[StreamResult]) -> None:
    for r in results:
        assert r.is_complete or r.is_clean_error, r


async def test_any_start_order_router_then_decodes_then_prefills(cluster: Restartable):
    log = cluster.start_order_log
    assert log["ready_alone"] == 503
    assert log["request_alone"][0] == 503 and b'"error"' in log["request_alone"][1]
    assert log["ready_without_prefill"] == 503
    assert log["request_without_prefill"][0] == 503
    assert log["router_ready_after_s"] < 10
    async with aiohttp.ClientSession() as s:
        assert await _short_requests(s, cluster.router.url, 4) == [200] * 4


async def test_killed_decode_fails_its_prefill_rooms_and_the_cluster_serves_on(
    cluster: Restartable,
):
    pre0, (dec0, dec1), rt = cluster.prefills[0], cluster.decodes, cluster.router
    async with aiohttp.ClientSession() as s:
        await _ensure_whole(s, cluster)
        old = (await get_json(s, f"{dec0.url}/server_info"))["incarnation"]
        room = f"stuck-{uuid.uuid4().hex}"  # a prefill room bound to decode-0 forever (60 s)
        port = await _bootstrap_port(s, pre0)
        stuck = asyncio.create_task(_decode_only(s, dec0, "127.0.0.1", port, room))
        await wait_for(lambda: _room_on(s, pre0, room), 10, "prefill room bound to decode-0")
        lost_before = (await scrape(s, pre0.url)).total("pdserve_transport_peers_lost_total")
        streams = _streams(s, rt.url, 8)
        for d in (dec0, dec1):
            await wait_for(lambda d=d: _running_on(s, d), 30, f"streams running on {d.name}")

        dec0.kill()
        killed_at = time.monotonic()

        async def room_gone() -> bool:
            return await _room_on(s, pre0, room) is None

        await wait_for(room_gone, 10, "room failed on prefill")
        assert time.monotonic() - killed_at <= LOST_AFTER_S + SLACK_S
        m = await scrape(s, pre0.url)
        assert m.total("pdserve_transport_peers_lost_total") > lost_before
        # Missed heartbeats, or a write to it that failed first: either way the peer is lost.
        assert sum(m.total("pdserve_rooms_ended_total", outcome=f"Failed:{why}")
                   for why in ("peer_lost", "transfer_error")) >= 1  # fmt: skip
        results = await asyncio.wait_for(asyncio.gather(*streams), 120)
        _assert_all_ended(results)
        assert any(r.is_clean_error for r in results)  # those that were on decode-0
        assert (await asyncio.wait_for(stuck, 30))[0] is None  # its server died under it
        for p, role in [*((p, "prefill") for p in cluster.prefills), (dec1, "decode")]:
            await wait_idle(s, p, role)
        await _serves_without(s, cluster, dec0, dec1, "decode")
        await _comes_back(s, cluster, dec0, "decode", old)


async def test_killed_prefill_fails_its_decode_rooms_and_the_cluster_serves_on(
    cluster: Restartable,
):
    (pre0, pre1), dec0, rt = cluster.prefills, cluster.decodes[0], cluster.router
    async with aiohttp.ClientSession() as s:
        await _ensure_whole(s, cluster)
        old = (await get_json(s, f"{pre0.url}/server_info"))["incarnation"]
        room = f"stuck-{uuid.uuid4().hex}"  # a decode room bound to prefill-0, KV never comes
        port = await _bootstrap_port(s, pre0)
        stuck = asyncio.create_task(_decode_only(s, dec0, "127.0.0.1", port, room))

        async def bound() -> bool:
            r = await _room_on(s, dec0, room)
            return r is not None and (r["peer"] or "").startswith("prefill-0@")

        await wait_for(bound, 10, "decode room bound to prefill-0")
        streams = _streams(s, rt.url, 8)
        await wait_for(lambda: _running_on(s, dec0), 30, "streams running")

        pre0.kill()
        killed_at = time.monotonic()
        status, body, _ = await asyncio.wait_for(stuck, 30)
        assert time.monotonic() - killed_at <= LOST_AFTER_S + SLACK_S
        assert status == 503 and body["error"]["code"] == "peer_lost", body
        _assert_all_ended(await asyncio.wait_for(asyncio.gather(*streams), 120))
        # The dead sender's pages stay fenced for the quarantine (5 s), then come back.
        for p, role in [(pre1, "prefill"), *((d, "decode") for d in cluster.decodes)]:
            await wait_idle(s, p, role, timeout_s=30)
        await _serves_without(s, cluster, pre0, pre1, "prefill")
        await _comes_back(s, cluster, pre0, "prefill", old)  # decodes re-register by themselves


async def test_killed_router_leaves_workers_idle_and_a_new_router_serves_at_once(
    cluster: Restartable,
):
    rt = cluster.router
    async with aiohttp.ClientSession() as s:
        await _ensure_whole(s, cluster)
        streams = _streams(s, rt.url, 6)
        await wait_for(lambda: _running_on(s, cluster.decodes[0]), 30, "streams running")

        rt.kill()
        results = await asyncio.wait_for(asyncio.gather(*streams), 30)
        assert all(r.exception is not None or r.is_complete for r in results), results
        for p, role in cluster.workers:  # the workers saw their client go and aborted
            await wait_idle(s, p, role)

        started = time.monotonic()
        await asyncio.to_thread(rt.start().wait_ready)
        assert await _short_requests(s, rt.url, 4) == [200] * 4
        assert time.monotonic() - started < 30


@pytest.mark.parametrize("target", ["dead_port", "not_a_bootstrap_server"])
async def test_decode_with_a_bad_bootstrap_address_fails_fast_with_bootstrap_error(
    cluster: Restartable, target: str
):
    dec1 = cluster.decodes[1]
    async with aiohttp.ClientSession() as s:
        await _ensure_whole(s, cluster)
        port = free_port() if target == "dead_port" else int(dec1.url.rsplit(":", 1)[1])
        room = f"bad-{uuid.uuid4().hex}"
        status, body, elapsed = await _decode_only(s, dec1, "127.0.0.1", port, room)
        assert status == 503 and body["error"]["code"] == "bootstrap_error", body
        assert elapsed < CONNECT_TIMEOUT_S + SLACK_S  # the bootstrap deadline is 30 s
        await wait_idle(s, dec1, "decode")
