"""The chaos benches' quick modes against real subprocess clusters (demo model, real NIXL):
whatever clients and processes do, every request ends and every server goes back to idle."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from bench.abort_storm import (
    ABORT_EARLY,
    ABORTED,
    COMPLETED,
    ERROR,
    MALFORMED,
    NEVER_ANSWERED,
    TRUNCATED,
    StormConfig,
    StormProgress,
    StormSummary,
    format_summary,
    quick_config,
    request_invariants,
    run_abort_storm,
    run_round,
)
from bench.chaos import format_chaos, quick_drain_config, run_chaos
from bench.chaos import quick_config as quick_chaos_config
from bench.cluster import ClusterSpec, Target, check_idle

# -- the bench's own judgement, against a misbehaving fake router/worker ---------------------

# Request i of a round behaves as BEHAVIOURS[i % 6] on the fake server.
BEHAVIOURS = ("good", "hang", "cut", "html_500", "sse_error", "openai_503")
EXPECTED = {"good": COMPLETED, "hang": NEVER_ANSWERED, "cut": TRUNCATED, "html_500": MALFORMED,
            "sse_error": ERROR, "openai_503": ERROR}  # fmt: skip


def _event(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _fake_completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    behaviour = BEHAVIOURS[int(request.headers["X-Request-Id"].rsplit("-", 1)[1]) % 6]
    if behaviour == "hang":
        await asyncio.Event().wait()  # never answers; the client's deadline must end it
    if behaviour == "html_500":
        return web.Response(status=500, text="<html>oops</html>")
    if behaviour == "openai_503":
        err = {"error": {"message": "busy", "type": "service_unavailable", "code": "x"}}
        return web.json_response(err, status=503)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_event({"choices": [{"text": "a", "finish_reason": None}]}))
    if behaviour == "cut":
        request.transport.close()  # the stream stops without [DONE]
        return resp
    if behaviour == "sse_error":
        await resp.write(_event({"error": {"message": "x", "type": "timeout", "code": "t"}}))
    else:
        n = body["max_tokens"]
        await resp.write(_event({"choices": [{"text": "b", "finish_reason": "length"}]}))
        await resp.write(_event({"choices": [], "usage": {"completion_tokens": n}}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _fake_metrics(request: web.Request) -> web.Response:
    text = ("pdserve_waiting_requests{role=\"decode\"} 1.0\n"
            "pdserve_kv_pages_free{role=\"decode\"} 10.0\n"
            "pdserve_kv_pages_total{role=\"decode\"} 12.0\n")  # fmt: skip
    return web.Response(text=text)


def _listing(data: list[dict]):
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"data": data})

    return handler


@pytest.fixture
async def fake_server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", _fake_completions)
    app.router.add_post("/v1/chat/completions", _fake_completions)
    app.router.add_get("/metrics", _fake_metrics)
    app.router.add_get("/debug/rooms", _listing([{"room_id": "r1"}]))
    app.router.add_get("/debug/requests", _listing([]))
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_storm_client_counts_hangs_cut_streams_and_non_openai_errors_as_failures(
    fake_server: str,
) -> None:
    cfg = StormConfig(router_url=fake_server, num_requests=12, concurrency=12, abort_fraction=0.0,
                      deadline_s=0.5, slack_s=0.3)  # fmt: skip
    async with aiohttp.ClientSession() as session:
        results = await run_round(session, cfg, "fake", StormProgress())
    assert [r.outcome for r in results] == [EXPECTED[BEHAVIOURS[i % 6]] for i in range(12)]
    summary = StormSummary()
    summary.add(results)
    failed = {i.name for i in request_invariants(summary) if not i.is_ok}
    assert failed == {"never answered = 0", "malformed answers = 0",
                      "streams cut without [DONE] = 0"}  # fmt: skip


async def test_storm_client_hangs_up_before_the_first_token_as_planned(fake_server: str) -> None:
    cfg = StormConfig(router_url=fake_server, num_requests=36, concurrency=36, abort_fraction=1.0,
                      max_early_abort_s=0.05, deadline_s=0.5, slack_s=0.3)  # fmt: skip
    async with aiohttp.ClientSession() as session:
        results = await run_round(session, cfg, "abort", StormProgress())
    early_on_hangs = [
        r for i, r in enumerate(results)
        if BEHAVIOURS[i % 6] == "hang" and r.abort == ABORT_EARLY
    ]  # fmt: skip
    assert early_on_hangs, "the seed drew no early disconnect on a hanging request"
    assert all(r.outcome == ABORTED and r.elapsed_s < 0.3 for r in early_on_hangs)


async def test_idle_check_reports_queued_requests_held_pages_and_live_rooms(
    fake_server: str,
) -> None:
    target = Target(fake_server, {"decode-0": fake_server})
    async with aiohttp.ClientSession() as session:
        report = await check_idle(session, target, max_wait_s=0.2)
    [worker] = report.workers
    assert not report.is_idle and not worker.is_idle
    assert worker.queues["pdserve_waiting_requests"] == 1
    assert (worker.pages_free, worker.pages_total) == (10, 12)
    assert (worker.num_debug_rooms, worker.num_debug_requests) == (1, 0)
    assert report.num_router_requests == 0


# -- the benches' quick modes on real clusters ------------------------------------------------


async def test_abort_storm_answers_every_request_and_leaves_every_server_idle(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    cfg = quick_config(seed=5)
    spec = ClusterSpec(model_dir=str(demo_model_dir), log_dir=str(tmp_path / "logs"))
    summary = await run_abort_storm(cfg, spec)
    report = format_summary(summary)
    assert summary.is_ok, report
    assert summary.num_tried == cfg.num_requests * cfg.num_rounds, report
    assert summary.num_never_answered == 0, report
    # The storm really stormed: clients hung up at both moments and the rest completed.
    assert summary.num_aborted_by_client >= 10, report
    assert summary.num_completed >= summary.num_tried // 2, report
    idle_checks = [i for i in summary.invariants if i.name.endswith(" idle")]
    assert len(idle_checks) == 2 * cfg.num_rounds, report  # prefill + decode, after every round


async def test_chaos_survives_decode_kill_with_migration_and_transport_faults(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    cfg = quick_chaos_config(seed=3)
    spec = ClusterSpec(model_dir=str(demo_model_dir), log_dir=str(tmp_path / "logs"), num_decode=2)
    summary = await run_chaos(cfg, spec)
    report = format_chaos(summary)
    assert summary.is_ok, report
    assert [p.name for p in summary.phases] == ["kill-migrate-0", "faults"], report
    assert summary.num_killed_peers == 1, report
    assert summary.total("num_never_answered") == 0, report
    kill, faults = summary.phases
    assert kill.restart_s is not None and kill.rejoin_s is not None, report
    assert kill.summary.num_completed > 0 and faults.summary.num_completed > 0, report
    # A decode died under load with a spare: no request failed (those mid-answer migrated;
    # tests/e2e/test_migration.py proves a migration deterministically).
    assert kill.migrations is not None, report
    assert kill.summary.num_errors + kill.summary.num_truncated == 0, report
    assert sum(faults.faults.values()) > 0, report  # --fault-plan reached the transport
    assert any("serves again" in i.name and i.is_ok for i in kill.summary.invariants), report


async def test_chaos_drain_and_rolling_restart_lose_no_request(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    cfg = quick_drain_config(seed=5)
    spec = ClusterSpec(
        model_dir=str(demo_model_dir), log_dir=str(tmp_path / "logs"), num_prefill=2, num_decode=2
    )
    summary = await run_chaos(cfg, spec)
    report = format_chaos(summary)
    assert summary.is_ok, report
    assert [p.name for p in summary.phases] == ["drain-0", "rolling-0"], report
    assert summary.total("num_never_answered") == 0, report
    assert summary.total("num_errors") == 0 and summary.total("num_truncated") == 0, report
    drain, rolling = summary.phases
    exits = [i for i in rolling.summary.invariants if i.name.endswith("drained and exited 0")]
    assert len(exits) == 4 and all(i.is_ok for i in exits), report  # every worker, in turn
    assert any(i.name == "rolling-0: failed = 0" and i.is_ok for i in rolling.summary.invariants)
    assert drain.summary.num_completed > 0 and rolling.summary.num_completed > 0, report
