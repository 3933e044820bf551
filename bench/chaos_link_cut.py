"""Chaos on several hosts: a host's network link is cut under load and plugged back in.

The cluster runs on network namespaces (bench/hosts.py: router on a gateway host, every worker
on its own host, KV over UCX's TCP transport on the links). Once enough of a storm round's
requests stream, the victim's cable is pulled (its switch port goes down: silence, no reset),
held until its peers and the router noticed, and plugged back in. Invariants, beyond the
storm's own (never answered = 0, no malformed answer, no stream cut without ``[DONE]``):

- the loss was seen from both sides: the victim's peers and the victim itself count a lost
  peer (``pdserve_transport_peers_lost_total``) and the router took it out of rotation;
- the fleet recovers with nothing restarted: every worker keeps its incarnation, the router
  lists them all healthy again, requests complete, the victim itself serves again;
- every worker idle after (queues 0, pages free, no rooms), and no Traceback in any log;
- UCX moved the KV over ``tcp/eth0`` only (what it logged it chose).

Recorded: how long detection and recovery took, rooms failed by reason (``peer_lost``,
deadlines, aborts), and the KV transfer rate over the veths.

    sudo python bench/chaos.py --link-cut decode --quick
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from bench.abort_storm import (
    Invariant,
    StormProgress,
    StormSummary,
    idle_invariants,
    request_invariants,
    run_round,
    traceback_invariant,
)
from bench.chaos import ChaosConfig, ChaosSummary, PhaseReport, serves_again
from bench.cluster import ClusterSpec, ManagedProc, check_idle, get_json, scrape
from bench.hosts import HostsCluster, hosts_cluster, kv_transfer_rate, ucx_transports
from bench.netns import unavailable_reason

PEERS_LOST = "pdserve_transport_peers_lost_total"
CUT_ROLES = ("decode", "prefill")


async def _sum(cluster: HostsCluster, procs: list[ManagedProc], name: str) -> float:
    total = 0.0
    for p in procs:
        total += (await scrape(cluster.session, p.url)).get(name, 0.0)
    return total


async def _incarnations(cluster: HostsCluster) -> dict[str, str]:
    out = {}
    for p in cluster.workers:
        out[p.name] = (await get_json(cluster.session, f"{p.url}/server_info"))["incarnation"]
    return out


async def _router_state(cluster: HostsCluster, url: str) -> str | None:
    listed = (await get_json(cluster.session, f"{cluster.router.url}/workers"))["data"]
    return next((w["state"] for w in listed if w["url"] == url), None)


async def _poll(check: Callable[[], Awaitable[bool]], max_wait_s: float) -> bool:
    """True once ``await check()`` holds within ``max_wait_s`` (errors count as not yet)."""
    deadline = time.monotonic() + max_wait_s
    while True:
        try:
            if await check():
                return True
        except (OSError, TimeoutError, KeyError, ValueError):
            pass
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)  # poll interval, bounded by the deadline


async def link_cut_phase(cluster: HostsCluster, cfg: ChaosConfig, role: str) -> PhaseReport:
    """One storm round during which the last ``role`` worker's host is cut off and back."""
    victim = (cluster.decodes if role == "decode" else cluster.prefills)[-1]
    peers = cluster.prefills if role == "decode" else cluster.decodes
    label = f"link-cut-{victim.name}"
    report = PhaseReport(label, StormSummary(), cut=victim.name)
    before = await _incarnations(cluster)
    peers_lost = await _sum(cluster, peers, PEERS_LOST)
    victim_lost = await _sum(cluster, [victim], PEERS_LOST)
    progress = StormProgress()
    storm = asyncio.create_task(run_round(cluster.session, cfg.storm, label, progress))
    num_in_flight = min(cfg.storm.concurrency, max(1, cfg.storm.num_requests // 4))
    await progress.wait_for(lambda p: p.num_streaming >= num_in_flight, cfg.storm.deadline_s)

    cut_at = time.monotonic()
    cluster.fabric.cut(cluster.host_of(victim))
    try:

        async def noticed() -> bool:
            lost = await _sum(cluster, peers, PEERS_LOST) > peers_lost
            return lost and await _router_state(cluster, victim.url) != "healthy"

        is_noticed = await _poll(noticed, cfg.max_recover_s)
        report.measured["detected_s"] = round(time.monotonic() - cut_at, 2)
    finally:
        cluster.fabric.restore(cluster.host_of(victim))
    report.measured["down_s"] = round(time.monotonic() - cut_at, 2)
    summary = report.summary
    summary.add(await storm)
    summary.invariants.append(
        Invariant(
            f"{label}: peers and router noticed", is_noticed, f"in {report.measured['detected_s']}s"
        )  # fmt: skip
    )
    summary.invariants += await _recovered(cluster, cfg, report, victim, before, victim_lost)
    summary.invariants[:0] = request_invariants(summary)
    idle = await check_idle(cluster.session, cluster.target(), cfg.max_idle_wait_s)
    summary.invariants += idle_invariants(idle, label)
    report.measured.update(await _figures(cluster))
    lanes = {
        lane for p in cluster.workers for s in ucx_transports(p.log_path).values() for lane in s
    }
    report.measured["ucx_lanes"] = ",".join(sorted(lanes))
    summary.invariants.append(
        Invariant(f"{label}: KV over tcp/eth0 only", lanes == {"tcp/eth0"}, f"{sorted(lanes)}")
    )
    return report


async def _recovered(
    cluster: HostsCluster,
    cfg: ChaosConfig,
    report: PhaseReport,
    victim: ManagedProc,
    before: dict[str, str],
    victim_lost: float,
) -> list[Invariant]:
    """After the cable is back: the same lives, seen healthy, serving, the victim too."""
    label, restored_at = report.name, time.monotonic()
    out = []
    try:
        await cluster.wait_router_sees_all(cfg.max_recover_s)
        report.rejoin_s = round(time.monotonic() - restored_at, 2)
        out.append(Invariant(f"{label}: router sees all healthy", True, f"+{report.rejoin_s}s"))
    except TimeoutError as e:
        out.append(Invariant(f"{label}: router sees all healthy", False, str(e)))
    after = await _incarnations(cluster)
    restarted = sorted(n for n in before if before[n] != after.get(n))
    out.append(Invariant(f"{label}: nothing restarted", not restarted, f"{restarted or 'none'}"))
    lost = await _sum(cluster, [victim], PEERS_LOST) - victim_lost
    out.append(Invariant(f"{label}: victim saw its peers lost", lost > 0, f"{lost:g}"))
    out.append(await serves_again(cluster, cfg, report.summary, label))
    out.append(await _victim_serves(cluster, cfg, report.summary, victim))
    return out


async def _victim_serves(
    cluster: HostsCluster, cfg: ChaosConfig, summary: StormSummary, victim: ManagedProc
) -> Invariant:
    """Requests one at a time until the victim finished one more (or the deadline)."""
    name = f"link-cut-{victim.name}: victim serves again"
    probe = replace(cfg.storm, num_requests=1, abort_fraction=0.0)
    start = await _sum(cluster, [victim], "pdserve_requests_total")
    deadline = time.monotonic() + cfg.max_recover_s
    for i in range(100):
        label = f"link-cut-{victim.name}-victim{i}"  # request ids: [A-Za-z0-9._:-]
        summary.add(await run_round(cluster.session, probe, label, StormProgress()))
        if await _sum(cluster, [victim], "pdserve_requests_total") > start:
            return Invariant(name, True, f"after {i + 1} request(s)")
        if time.monotonic() > deadline:
            break
    return Invariant(name, False, f"no request finished on {victim.name}")


async def _figures(cluster: HostsCluster) -> dict[str, float | str]:
    """Rooms failed by reason on every worker, and the prefills' KV transfer rate."""
    out: dict[str, float | str] = {}
    for p in cluster.workers:
        m = await scrape_outcomes(cluster, p)
        for outcome, n in m.items():
            if outcome.startswith("Failed:") and n:
                key = f"rooms_{outcome.split(':')[1].split(' ')[0]}"
                out[key] = out.get(key, 0.0) + n  # type: ignore[operator]
    rate = await kv_transfer_rate(cluster.session, cluster.prefills)
    out["kv_transfer_gb_per_s"] = round(rate.gb_per_s, 4)
    out["kv_transfer_mb"] = round(rate.num_bytes / 1e6, 2)
    out["kv_rooms"] = rate.num_rooms
    return out


async def scrape_outcomes(cluster: HostsCluster, proc: ManagedProc) -> dict[str, float]:
    """``pdserve_rooms_ended_total`` of one worker by outcome label."""
    async with cluster.session.get(f"{proc.url}/metrics") as resp:
        text = (await resp.read()).decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdserve_rooms_ended_total":
                out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0.0) + s.value
    return out


async def run_link_cut(cfg: ChaosConfig, spec: ClusterSpec, role: str = "decode") -> ChaosSummary:
    """The link-cut phase on a fresh fleet of hosts (2 prefills, 2 decodes at least)."""
    if role not in CUT_ROLES:
        raise ValueError(f"link cut takes a role among {CUT_ROLES}, got {role!r}")
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(f"link cut needs network namespaces: {reason}")
    spec = replace(spec, num_prefill=max(2, spec.num_prefill), num_decode=max(2, spec.num_decode))
    started = time.monotonic()
    async with hosts_cluster(spec) as cluster:
        out = ChaosSummary(log_dir=str(cluster.log_dir))
        cfg = replace(cfg, storm=replace(cfg.storm, router_url=cluster.router.url))
        out.phases.append(await link_cut_phase(cluster, cfg, role))
        out.invariants.append(traceback_invariant(cluster.target()))
    out.wall_s = round(time.monotonic() - started, 2)
    return out
