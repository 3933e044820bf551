"""Chaos phases of graceful ends: a *drain phase* SIGTERMs one worker while a storm round is in
flight (the worker drains: readiness off, new requests turned away with a retryable 503 that the
router retries elsewhere, requests in flight finish) and starts it again; a *rolling phase*
does that to every worker in turn, one at a time, under one storm round.

Invariants on top of the storm's own (never answered = 0, no malformed answer, all tokens, no
cut stream): every drained worker exits 0; with two or more workers of each drained role no
request fails (errors = 0: a drain must cost nothing when another worker can serve); the
router sees every worker's new life; every worker idle afterwards.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable

from bench.abort_storm import Invariant, StormConfig, StormProgress, StormSummary, run_round
from bench.cluster import Cluster, ManagedProc

DRAIN_EXIT_S = 60.0  # SIGTERM -> exit: the workers' --drain-timeout (30 s) plus start-up slack


async def drain_proc(cluster: Cluster, proc: ManagedProc, max_exit_s: float) -> Invariant:
    """SIGTERM ``proc`` (a drain), wait for its exit, start it again and wait until ready."""
    assert proc.popen is not None and proc.is_running
    started = time.monotonic()
    os.killpg(proc.popen.pid, signal.SIGTERM)
    try:
        code = await asyncio.to_thread(proc.popen.wait, max_exit_s)
    except Exception as e:  # subprocess.TimeoutExpired: it did not end its drain
        await asyncio.to_thread(proc.kill)
        return Invariant(f"{proc.name} drained and exited 0", False, f"{type(e).__name__}: {e}")
    took = time.monotonic() - started
    proc.start()
    await proc.wait_ready(cluster.session, cluster.spec.max_ready_s)
    return Invariant(f"{proc.name} drained and exited 0", code == 0, f"code {code} in {took:.1f}s")


def can_lose_none(cluster: Cluster, victims: list[ManagedProc]) -> bool:
    """Every drained role has another worker to serve while one drains."""
    by_role = {"prefill": cluster.prefills, "decode": cluster.decodes}
    return all(len(by_role.get(p.role, [])) >= 2 for p in victims)


def no_failures(summary: StormSummary, label: str) -> Invariant:
    n = summary.num_errors + summary.num_truncated
    kinds = summary.errors_by_kind or {}
    return Invariant(f"{label}: failed = 0", n == 0, f"{n} {kinds}" if n else "0")


async def graceful_phase(
    cluster: Cluster,
    storm_cfg: StormConfig,
    label: str,
    victims: list[ManagedProc],
    rejoin: Callable[[], Awaitable[Invariant]],
) -> tuple[StormSummary, list[Invariant]]:
    """One storm round; once part of it streams, drain ``victims`` one after the other (each
    back and seen by the router before the next). Returns the round's summary and the
    phase's own invariants (request and idle checks are the caller's)."""
    progress = StormProgress()
    storm = asyncio.create_task(run_round(cluster.session, storm_cfg, label, progress))
    num_in_flight = min(storm_cfg.concurrency, max(1, storm_cfg.num_requests // 4))
    await progress.wait_for(lambda p: p.num_streaming >= num_in_flight, storm_cfg.deadline_s)
    checks = []
    for proc in victims:
        checks.append(await drain_proc(cluster, proc, DRAIN_EXIT_S))
        checks.append(await rejoin())
    summary = StormSummary()
    summary.add(await storm)
    if can_lose_none(cluster, victims):
        checks.append(no_failures(summary, label))
    return summary, checks
