"""Observability of stuck and finished work on a live PD cluster: queue and room gauges, the
oldest-age gauge, /debug/rooms and /debug/requests, counters, and DEBUG logs that tell a room's
life (room id, request id, from -> to, trigger, reason).

A stuck request is made on purpose: the decode leg alone, naming a live prefill's bootstrap
server, so its KV never comes; the decode's short room deadline ends it.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.e2e.conftest import (
    Cluster,
    Metrics,
    assign_distinct_ports,
    fetch,
    get_json,
    idle_problems,
    router,
    scrape,
    stream_completion,
    wait_for,
    wait_idle,
    worker,
)

STUCK_DEADLINE_S = 3.0  # the decode's WaitingForInput deadline; the prefill keeps its 60 s
DECODE_DEADLINES = ["--timeout-bootstrap", "10", "--timeout-waiting-for-input", "3",
                    "--timeout-transfer", "3", "--timeout-waiting-for-kv", "10"]  # fmt: skip
SLACK_S = 3.0
AGE_STEP_S = 0.5  # how much the oldest-age gauge must grow while we watch
WAITING = "WaitingForInput"
STREAM = {"model": "demo", "prompt": "Tell me", "max_tokens": 64, "ignore_eos": True}
COUNTER_FAMILIES = ["pdserve_request_timeouts", "pdserve_room_timeouts", "pdserve_aborts",
                    "pdserve_fsm_rejected_transitions", "pdserve_rooms_ended",
                    "pdserve_transport_peers_lost"]  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("observability")
    pre = worker(tmp, "prefill-0", "prefill", demo_model_dir)
    dec = worker(tmp, "decode-0", "decode", demo_model_dir, *DECODE_DEADLINES)
    rt = router(tmp, [pre], [dec])
    c = Cluster(pre, dec, rt)
    assign_distinct_ports(c.procs)
    for p in c.procs:
        p.env["PDSERVE_LOG_LEVEL"] = "DEBUG"
    with c.running():
        yield c


# -- a stuck request, observed once for the tests below -------------------------------------------


@dataclass
class StuckRun:
    request_id: str
    room_id: str
    decode_rooms: list[dict[str, Any]] = field(default_factory=list)  # while stuck
    decode_requests: list[dict[str, Any]] = field(default_factory=list)
    prefill_rooms: list[dict[str, Any]] = field(default_factory=list)
    metrics_early: Metrics | None = None
    metrics_later: Metrics | None = None
    status: int = 0
    body: Any = None
    elapsed_s: float = 0.0
    idle_problems: list[str] = field(default_factory=list)  # after the end
    decode_after: Metrics | None = None
    prefill_after: Metrics | None = None


def _oldest(m: Metrics, kind: str) -> float:
    ages = m.by_label("pdserve_oldest_nonterminal_age_seconds", "state")
    return max((a for s, a in ages.items() if s.startswith(f"{kind}:")), default=0.0)


async def _observe_stuck(c: Cluster) -> StuckRun:
    pre, dec = c.prefill, c.decode
    run = StuckRun(f"stuck-{uuid.uuid4().hex}", f"stuck-{uuid.uuid4().hex}")
    async with aiohttp.ClientSession() as s:
        port = (await get_json(s, f"{pre.url}/server_info"))["bootstrap_port"]
        kv = {"room_id": run.room_id, "bootstrap_host": "127.0.0.1", "bootstrap_port": port}
        body = {**STREAM, "stream": False, "kv_transfer_params": kv}
        started = time.monotonic()
        headers = {"X-Request-Id": run.request_id}
        task = asyncio.create_task(fetch(s, "POST", f"{dec.url}/v1/completions", body, headers))

        async def listed() -> bool:  # the pages reached the prefill, and the decode knows it
            for p in (pre, dec):
                rooms = (await get_json(s, f"{p.url}/debug/rooms"))["data"]
                if not any(r["id"] == run.room_id and r["state"] == WAITING for r in rooms):
                    return False
            return True

        await wait_for(listed, STUCK_DEADLINE_S, "the stuck room on both sides")
        run.metrics_early = await scrape(s, dec.url)
        run.decode_rooms = (await get_json(s, f"{dec.url}/debug/rooms"))["data"]
        run.decode_requests = (await get_json(s, f"{dec.url}/debug/requests"))["data"]
        run.prefill_rooms = (await get_json(s, f"{pre.url}/debug/rooms"))["data"]
        early = _oldest(run.metrics_early, "room")

        async def older() -> Metrics | None:
            m = await scrape(s, dec.url)
            return m if _oldest(m, "room") >= early + AGE_STEP_S else None

        run.metrics_later = await wait_for(older, STUCK_DEADLINE_S, "the oldest age to grow")
        status, raw = await asyncio.wait_for(task, STUCK_DEADLINE_S + 30)
        run.status, run.body, run.elapsed_s = status, orjson.loads(raw), time.monotonic() - started
        for p, role in ((pre, "prefill"), (dec, "decode")):
            try:
                await wait_idle(s, p, role, timeout_s=20)
            except AssertionError as exc:
                run.idle_problems.append(str(exc))
        run.decode_after, run.prefill_after = await scrape(s, dec.url), await scrape(s, pre.url)
    return run


@pytest.fixture(scope="module")
def stuck(cluster: Cluster) -> StuckRun:
    return asyncio.run(_observe_stuck(cluster))


def test_stuck_room_is_listed_with_state_age_deadline_last_transition_and_reason(
    stuck: StuckRun,
):
    (room,) = [r for r in stuck.decode_rooms if r["id"] == stuck.room_id]
    assert room["state"] == "WaitingForInput" and room["request_id"] == stuck.request_id
    assert room["age_s"] > 0 and 0 < room["deadline_in_s"] <= STUCK_DEADLINE_S
    assert room["last_transition"] == ["bootstrapped", "Bootstrapping", "WaitingForInput", None]
    assert "reason" in room and room["peer"].startswith("prefill-0@")
    (sender,) = [r for r in stuck.prefill_rooms if r["id"] == stuck.room_id]
    assert sender["state"] == "WaitingForInput" and sender["peer"].startswith("decode-0@")
    (req,) = [r for r in stuck.decode_requests if r["request_id"] == stuck.request_id]
    assert req["room_id"] == stuck.room_id and req["age_s"] > 0 and "reason" in req


def test_oldest_age_gauge_grows_while_stuck_and_is_zero_after(stuck: StuckRun):
    early, later = stuck.metrics_early, stuck.metrics_later
    assert early is not None and later is not None and stuck.decode_after is not None
    for kind in ("room", "request"):
        assert _oldest(later, kind) >= _oldest(early, kind) + AGE_STEP_S > AGE_STEP_S
    for m in (stuck.decode_after, stuck.prefill_after):
        assert m is not None
        ages = m.by_label("pdserve_oldest_nonterminal_age_seconds", "state")
        assert {"request:waiting", "request:running", "room:WaitingForInput"} <= set(ages)
        assert set(ages.values()) == {0.0}


def test_stuck_request_ends_with_timeout_and_everything_returns_to_zero(stuck: StuckRun):
    assert stuck.status == 504, stuck.body
    assert stuck.body["error"]["code"] == "timeout:WaitingForInput"
    assert STUCK_DEADLINE_S - 0.5 <= stuck.elapsed_s <= STUCK_DEADLINE_S + SLACK_S
    assert not stuck.idle_problems
    dec, pre = stuck.decode_after, stuck.prefill_after
    assert dec is not None and pre is not None
    assert dec.total("pdserve_room_timeouts_total", state="WaitingForInput") >= 1
    assert dec.total("pdserve_rooms_ended_total", outcome="Failed:timeout:WaitingForInput") >= 1
    assert pre.total("pdserve_rooms_ended_total", outcome="Failed:aborted") >= 1  # told by decode


def test_timeout_abort_and_rejected_transition_counters_exist(stuck: StuckRun):
    for m in (stuck.decode_after, stuck.prefill_after):
        assert m is not None
        assert not set(COUNTER_FAMILIES) - m.families


def test_stuck_decode_request_is_counted_as_waiting_for_kv(stuck: StuckRun):
    (req,) = [r for r in stuck.decode_requests if r["request_id"] == stuck.request_id]
    m = stuck.metrics_early
    assert m is not None
    assert req["state"] == "waiting_for_kv"
    assert m.get("pdserve_decode_waiting_for_kv_requests", role="decode") == 1
    assert m.get("pdserve_waiting_requests", role="decode") == 0


def test_debug_requests_show_deadline_and_last_transition(stuck: StuckRun):
    (req,) = [r for r in stuck.decode_requests if r["request_id"] == stuck.request_id]
    assert any("deadline" in key for key in req), req
    assert any("transition" in key for key in req), req


async def test_abort_of_a_decode_request_waiting_for_kv_ends_its_room(cluster: Cluster):
    pre, dec = cluster.prefill, cluster.decode
    rid, room = f"abort-{uuid.uuid4().hex}", f"abort-{uuid.uuid4().hex}"
    outcome = "pdserve_rooms_ended_total"
    async with aiohttp.ClientSession() as s:
        port = (await get_json(s, f"{pre.url}/server_info"))["bootstrap_port"]
        kv = {"room_id": room, "bootstrap_host": "127.0.0.1", "bootstrap_port": port}
        body = {**STREAM, "stream": False, "kv_transfer_params": kv}
        url = f"{dec.url}/v1/completions"
        task = asyncio.create_task(fetch(s, "POST", url, body, {"X-Request-Id": rid}))

        async def bound() -> bool:
            rooms = (await get_json(s, f"{dec.url}/debug/rooms"))["data"]
            return any(r["id"] == room and r["state"] == "WaitingForInput" for r in rooms)

        await wait_for(bound, STUCK_DEADLINE_S, "the room waiting for KV")
        before = await scrape(s, dec.url)
        assert (await fetch(s, "POST", f"{dec.url}/abort/{rid}"))[0] == 200
        await asyncio.wait_for(task, STUCK_DEADLINE_S + 30)
        await wait_idle(s, dec, "decode", timeout_s=20)
        await wait_idle(s, pre, "prefill", timeout_s=20)
        after = await scrape(s, dec.url)
    aborted = after.total(outcome, outcome="Failed:aborted") - before.total(
        outcome, outcome="Failed:aborted"
    )
    assert aborted == 1  # not "Failed:timeout:WaitingForInput" once the deadline passed


def test_logs_explain_the_stuck_room_life_on_both_sides(cluster: Cluster, stuck: StuckRun):
    room, rid = stuck.room_id, stuck.request_id
    decode_log, prefill_log = cluster.decode.log_text(), cluster.prefill.log_text()
    assert _transitions(decode_log, room) == [
        ("created", "Bootstrapping", None),
        ("Bootstrapping", "WaitingForInput", "None"),
        ("WaitingForInput", "Failed", "timeout:WaitingForInput"),
    ]
    assert _transitions(prefill_log, room) == [
        ("created", "Bootstrapping", None),
        ("Bootstrapping", "WaitingForInput", "None"),
        ("WaitingForInput", "Failed", "aborted: by decode (timeout:WaitingForInput)"),
    ]
    assert re.search(
        rf"req={rid} room={room} \w+ -> finished reason=KV transfer timed out", decode_log
    )


# -- logs of a room's life, and a burst with client disconnects ---------------------------------


def _transitions(log: str, room_id: str) -> list[tuple[str, str, str | None]]:
    """(from, to, reason) of every transition a table logged for ``room_id``."""
    pattern = re.compile(
        rf"room={re.escape(room_id)} req=\S+ side=\w+ (\w+) -> (\w+)"
        r"(?: trigger=\w+ reason=(.*)| peer=\S*)$"
    )
    return [m.groups() for line in log.splitlines() if (m := pattern.search(line)) is not None]


def _is_chain_to_success(steps: list[tuple[str, str, str | None]]) -> bool:
    """created -> ... -> Success, each step starting where the previous one ended."""
    if not steps or steps[0][0] != "created" or steps[-1][1] != "Success":
        return False
    return all(prev[1] == step[0] for prev, step in zip(steps, steps[1:], strict=False))


async def test_logs_explain_a_routed_room_life_on_both_sides(cluster: Cluster):
    rid = f"life-{uuid.uuid4().hex}"
    async with aiohttp.ClientSession() as s:
        body = {**STREAM, "stream": False, "max_tokens": 4}
        url = f"{cluster.router.url}/v1/completions"
        assert (await fetch(s, "POST", url, body, {"X-Request-Id": rid}))[0] == 200
        decode, prefill = cluster.decode, cluster.prefill
        found = re.search(rf"req={rid} room=(\S+) ", decode.log_text())
        assert found is not None
        room = found.group(1)

        async def told() -> bool:  # log lines may trail the answer by a few milliseconds
            return all(_is_chain_to_success(_transitions(p.log_text(), room))
                       for p in (decode, prefill))  # fmt: skip

        await wait_for(told, 10, f"room {room} logged to Success on both sides")
        assert re.search(rf"req={rid} room={room} \w+ -> running reason=kv received",
                         decode.log_text())  # fmt: skip
        for step in (
            "waiting -> prefilling reason=prefill starts",
            "prefilling -> prefill_inflight reason=prefilled",
            "prefill_inflight -> finished",
        ):
            assert f"req={rid} room={room} {step}" in prefill.log_text()


async def test_after_a_burst_with_client_disconnects_every_worker_shows_zero(cluster: Cluster):
    pre, dec, rt = cluster.prefill, cluster.decode, cluster.router
    async with aiohttp.ClientSession() as s:
        before = {p.name: await scrape(s, p.url) for p in cluster.procs}
        results = await _burst(s, rt.url, num_requests=16, num_mid_stream=3, num_early=3)
        kept = [r for r in results if r is not None]
        assert all(r.is_complete or r.is_clean_error for r in kept), kept
        assert sum(r.is_complete for r in kept) >= len(kept) // 2
        for p, role in ((pre, "prefill"), (dec, "decode")):
            await wait_idle(s, p, role)
            assert not await idle_problems(s, p, role)
        assert (await get_json(s, f"{rt.url}/debug/requests"))["data"] == []
        after = {p.name: await scrape(s, p.url) for p in cluster.procs}
        assert set(
            after["router"].by_label("pdserve_router_worker_in_flight", "role").values()
        ) == {0}
        disconnects = "pdserve_router_client_disconnects_total"
        assert after["router"].total(disconnects) - before["router"].total(disconnects) >= 1
        aborts = sum(after[p.name].total("pdserve_aborts_total") - before[p.name].total(
            "pdserve_aborts_total") for p in (pre, dec))  # fmt: skip
        assert aborts >= 1


async def _burst(
    s: aiohttp.ClientSession, url: str, num_requests: int, num_mid_stream: int, num_early: int
) -> list[Any]:
    """Streamed requests of mixed sizes; the first ones hang up mid-stream or before their
    first byte. Returns each result, None for those that hung up."""
    started = []
    for i in range(num_requests):
        body = {**STREAM, "prompt": "word " * (1 + 13 * (i % 5)), "max_tokens": 16 + 8 * (i % 4)}
        rid, first = f"burst-{i}-{uuid.uuid4().hex}", asyncio.Event()
        coro = stream_completion(s, url, body, {"X-Request-Id": rid}, 60, first)
        started.append((rid, first, asyncio.create_task(coro)))
    for _, first, task in started[:num_mid_stream]:
        await asyncio.wait_for(first.wait(), 60)
        task.cancel()

    async def in_flight(rid: str, task: asyncio.Task[Any]) -> bool:
        data = (await get_json(s, f"{url}/debug/requests"))["data"]
        return task.done() or any(r["request_id"] == rid for r in data)

    for rid, _, task in started[num_mid_stream : num_mid_stream + num_early]:
        await wait_for(lambda r=rid, t=task: in_flight(r, t), 30, f"{rid} at the router")
        task.cancel()  # a no-op if it already ended
    done = await asyncio.wait_for(
        asyncio.gather(*(t for _, _, t in started), return_exceptions=True), 120
    )
    return [None if isinstance(r, asyncio.CancelledError) else r for r in done]
