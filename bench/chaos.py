"""Chaos: the abort storm while peers die. Each *kill phase* runs one storm round and, once
enough of its requests are streaming, SIGKILLs one process (decode, then prefill, then router),
restarts it on the same ports and lets the round finish; the *migrate* phase does the same to a
decode while another decode is healthy, and with the router's request migration on no request
may fail (streams cut mid-answer continue on the spare decode); the *faults phase* restarts the
workers with the transport's fault injection (delayed writes, failed transfers, dropped
notifications) and runs a round on them. The *graceful phases* (bench/chaos_drain.py) SIGTERM
instead: ``drain`` drains one decode under a storm round, ``rolling`` drains and restarts every
worker in turn; with two workers of each role no request may fail there. ``--link-cut ROLE``
instead cuts a worker host's network link under load, on network namespaces
(bench/chaos_link_cut.py). After every phase:

- the abort storm's request invariants (never answered = 0, no malformed answer, completed
  requests have all their tokens; streams cut without ``[DONE]`` only when the router died);
- the restarted process rejoins with no action anywhere else: the router lists every worker
  healthy with its current incarnation, and requests complete again;
- every worker idle (queue gauges 0, pages free == total, ``/debug`` empty), router idle;
- and at the end: no ``Traceback`` in any log (all lives of every process).

    python bench/chaos.py --quick
    python bench/chaos.py --quick-drain        # drain + rolling restart, 2 prefills + 2 decodes
    python bench/chaos.py --requests 300 --concurrency 24 --rounds 2 --seed 1 --num-decode 2
    sudo python bench/chaos.py --quick --link-cut decode
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from anywhere

from bench.abort_storm import (  # noqa: E402
    COMPLETED,
    Invariant,
    StormConfig,
    StormProgress,
    StormSummary,
    add_size_args,
    cluster_spec_from_args,
    idle_invariants,
    request_invariants,
    run_round,
    storm_config_from_args,
    traceback_invariant,
)
from bench.chaos_drain import graceful_phase  # noqa: E402
from bench.cluster import Cluster, ClusterSpec, ManagedProc, check_idle, scrape  # noqa: E402

QUICK = {"num_requests": 100, "concurrency": 12, "num_rounds": 1}
KILL_ROLES = ("migrate", "decode", "prefill", "router")  # migrate: a decode, with a spare
MIGRATIONS = "pdserve_router_migrations_total"
MIGRATE_MAX_TOKENS = 96
GRACEFUL = ("drain", "rolling")  # bench/chaos_drain.py: SIGTERM one decode; every worker in turn
CHAOS_RATE = 8.0  # requests/s: a round spans the kill, the downtime and the restart


@dataclass(frozen=True)
class ChaosConfig:
    """``storm.num_rounds`` cycles of one kill phase per role in ``kill_roles``, then (when
    ``prefill_faults``/``decode_faults`` are set) one faults phase. Fault plans are the JSON
    of ``pdserve serve --fault-plan``."""

    storm: StormConfig
    kill_roles: tuple[str, ...] = KILL_ROLES
    graceful: tuple[str, ...] = GRACEFUL  # drain / rolling-restart phases, after the kills
    prefill_faults: str | None = '{"delay_s": 0.005, "fail_transfer_prob": 0.02}'
    decode_faults: str | None = '{"drop_notif_prob": 0.05}'
    num_recovery_requests: int = 6  # a burst that must complete after each restart
    max_recover_s: float = 60.0
    max_idle_wait_s: float = 30.0


@dataclass
class PhaseReport:
    """One phase: its storm's counts and invariants, what was killed, how fast it came back."""

    name: str
    summary: StormSummary
    killed: str | None = None
    restart_s: float | None = None  # SIGKILL -> the new process answers /health/ready
    rejoin_s: float | None = None  # ready -> the router uses it again (nothing else restarted)
    faults: dict[str, float] = field(default_factory=dict)
    cut: str | None = None  # the host whose link was cut (bench/chaos_link_cut.py)
    measured: dict[str, float | str] = field(default_factory=dict)  # a phase's own figures
    migrations: int | None = None  # streams the router resumed elsewhere (migrate phase)


@dataclass
class ChaosSummary:
    phases: list[PhaseReport] = field(default_factory=list)
    invariants: list[Invariant] = field(default_factory=list)  # whole-run checks
    log_dir: str | None = None
    wall_s: float = 0.0

    @property
    def is_ok(self) -> bool:
        checks = self.invariants + [i for p in self.phases for i in p.summary.invariants]
        return all(i.is_ok for i in checks)

    def total(self, attr: str) -> int:
        return sum(getattr(p.summary, attr) for p in self.phases)

    @property
    def num_killed_peers(self) -> int:
        return sum(1 for p in self.phases if p.killed)

    def to_json(self) -> dict:
        totals = {a: self.total(a) for a in ("num_tried", "num_aborted_by_client", "num_errors",
                                              "num_never_answered", "num_truncated")}  # fmt: skip
        return {**asdict(self), "totals": totals, "num_killed_peers": self.num_killed_peers,
                "is_ok": self.is_ok}  # fmt: skip


def _victim(cluster: Cluster, role: str, cycle: int) -> ManagedProc:
    """The process of ``role`` to kill in this cycle (rotating when there are several)."""
    procs = {"decode": cluster.decodes, "migrate": cluster.decodes, "prefill": cluster.prefills,
             "router": [cluster.router]}  # fmt: skip
    candidates = procs[role]
    return candidates[cycle % len(candidates)]


async def kill_phase(cluster: Cluster, cfg: ChaosConfig, role: str, cycle: int) -> PhaseReport:
    """A storm round during which one ``role`` process is SIGKILLed and restarted."""
    label = f"kill-{role}-{cycle}"
    victim = _victim(cluster, role, cycle)
    report = PhaseReport(label, StormSummary(), killed=victim.name)
    progress = StormProgress()
    migrations_before = (await scrape(cluster.session, cluster.router.url)).get(MIGRATIONS, 0)
    storm_cfg = cfg.storm
    if role == "migrate":  # longer streams: many are mid-answer on the victim when it dies
        storm_cfg = replace(storm_cfg, max_tokens=max(storm_cfg.max_tokens, MIGRATE_MAX_TOKENS))
    storm = asyncio.create_task(run_round(cluster.session, storm_cfg, label, progress))
    # Kill under load: once a good part of the round is in flight (or it is over anyway).
    num_in_flight = min(cfg.storm.concurrency, max(1, cfg.storm.num_requests // 4))
    await progress.wait_for(lambda p: p.num_streaming >= num_in_flight, cfg.storm.deadline_s)
    killed_at = time.monotonic()
    await asyncio.to_thread(victim.kill)
    victim.start()
    await victim.wait_ready(cluster.session, cluster.spec.max_ready_s)
    report.restart_s = round(time.monotonic() - killed_at, 2)
    rejoin = asyncio.create_task(_rejoin(cluster, cfg, report, label))  # while the storm goes on
    report.summary.add(await storm)
    report.summary.invariants.append(await rejoin)
    await _after_restart(cluster, cfg, report, label)
    if role == "migrate":
        migrations = (await scrape(cluster.session, cluster.router.url)).get(MIGRATIONS, 0)
        report.migrations = int(migrations - migrations_before)
        report.summary.invariants += migrate_invariants(cluster, report)
    return report


async def drain_phase(cluster: Cluster, cfg: ChaosConfig, kind: str, cycle: int) -> PhaseReport:
    """``drain``: SIGTERM one decode under a storm round; ``rolling``: every worker in turn."""
    label = f"{kind}-{cycle}"
    if kind == "drain":
        victims = [_victim(cluster, "decode", cycle)]
    else:
        victims = list(cluster.workers)
    report = PhaseReport(label, StormSummary(), killed=None)
    summary, checks = await graceful_phase(
        cluster, cfg.storm, label, victims, lambda: _rejoin(cluster, cfg, report, label)
    )
    report.summary = summary
    summary.invariants += checks
    await _after_restart(cluster, cfg, report, label)
    return report


def migrate_invariants(cluster: Cluster, report: PhaseReport) -> list[Invariant]:
    """With migration on and a healthy spare decode, a decode's death fails no request."""
    q, label = report.summary, report.name
    num_failed = q.num_errors + q.num_truncated
    detail = f"{num_failed} ({dict(q.errors_by_kind)})"
    return [
        Invariant(f"{label}: a spare decode", len(cluster.decodes) >= 2, f"{len(cluster.decodes)}"),
        Invariant(f"{label}: requests failed = 0", num_failed == 0, detail),
    ]  # how many streams were mid-answer on the victim is luck: reported, not required


async def _rejoin(cluster: Cluster, cfg: ChaosConfig, report: PhaseReport, label: str) -> Invariant:
    """From the restarted process's readiness until the router uses every worker's current
    life; nothing else is restarted or told anything."""
    ready_at = time.monotonic()
    name = f"{label}: rejoined with no action"
    try:
        await cluster.wait_router_sees_all(cfg.max_recover_s)
    except TimeoutError as e:
        return Invariant(name, False, str(e))
    report.rejoin_s = round(time.monotonic() - ready_at, 2)
    return Invariant(name, True, f"router sees every worker's new life {report.rejoin_s}s after")


async def _after_restart(
    cluster: Cluster, cfg: ChaosConfig, report: PhaseReport, label: str
) -> None:
    """Recovery, request and idle invariants of a phase."""
    summary = report.summary
    summary.invariants.append(await serves_again(cluster, cfg, summary, label))
    is_router_killed = report.killed == cluster.router.name
    summary.invariants[:0] = request_invariants(summary, allow_truncated=is_router_killed)
    idle = await check_idle(cluster.session, cluster.target(), cfg.max_idle_wait_s)
    summary.invariants += idle_invariants(idle, label)


async def serves_again(
    cluster: Cluster, cfg: ChaosConfig, summary: StormSummary, label: str
) -> Invariant:
    """One request at a time until one completes (a breaker may still be half-open), then a
    burst that must complete in full. Their results count in the phase's summary."""
    probe = replace(cfg.storm, router_url=cluster.router.url, num_requests=1, abort_fraction=0.0)
    deadline = time.monotonic() + cfg.max_recover_s
    num_probes = 0
    while True:
        label_i = f"{label}-probe{num_probes}"
        [result] = await run_round(cluster.session, probe, label_i, StormProgress())
        summary.add([result])
        num_probes += 1
        if result.outcome == COMPLETED:
            break
        if time.monotonic() > deadline:
            return Invariant(f"{label}: serves again", False, f"last: {result.error_kind}")
        await asyncio.sleep(0.1)  # poll interval of a recovery check with a deadline
    n = cfg.num_recovery_requests
    burst = replace(probe, num_requests=n, concurrency=n)
    results = await run_round(cluster.session, burst, f"{label}-burst", StormProgress())
    summary.add(results)
    bad = [f"{r.request_id}: {r.outcome} {r.error_kind}" for r in results if r.outcome != COMPLETED]
    return Invariant(f"{label}: serves again", not bad, "; ".join(bad) or f"{n}/{n} completed")


async def faults_phase(cluster: Cluster, cfg: ChaosConfig) -> PhaseReport:
    """Restart the workers with fault plans, run a storm round on them."""
    label = "faults"
    report = PhaseReport(label, StormSummary())
    restarts = [
        cluster.restart(proc, ("--fault-plan", _with_seed(plan, cfg.storm.seed + i)))
        for i, (proc, plan) in enumerate(_fault_targets(cluster, cfg))
    ]
    await asyncio.gather(*restarts)
    rejoined = await _rejoin(cluster, cfg, report, label)
    summary = report.summary
    summary.add(await run_round(cluster.session, cfg.storm, label, StormProgress()))
    summary.invariants = [*request_invariants(summary), rejoined]
    idle = await check_idle(cluster.session, cluster.target(), cfg.max_idle_wait_s)
    summary.invariants += idle_invariants(idle, label)
    report.faults = await fault_counters(cluster)
    injected = sum(report.faults.values())
    summary.invariants.append(Invariant("faults: injected", injected > 0, f"{report.faults}"))
    return report


async def fault_counters(cluster: Cluster) -> dict[str, float]:
    """``pdserve_transport_fault_*`` summed over the workers: what was really injected."""
    out: dict[str, float] = {}
    for proc in cluster.workers:
        for key, value in (await scrape(cluster.session, proc.url)).items():
            if key.startswith("pdserve_transport_fault_") and key.endswith("_total"):
                name = key.removeprefix("pdserve_transport_fault_").removesuffix("_total")
                out[name] = out.get(name, 0) + value
    return out


def _fault_targets(cluster: Cluster, cfg: ChaosConfig) -> list[tuple[ManagedProc, str]]:
    out = [(p, cfg.prefill_faults) for p in cluster.prefills if cfg.prefill_faults]
    return out + [(d, cfg.decode_faults) for d in cluster.decodes if cfg.decode_faults]


def _with_seed(plan: str, seed: int) -> str:
    return json.dumps({"seed": seed, **json.loads(plan)})


async def run_phases(cluster: Cluster, cfg: ChaosConfig) -> ChaosSummary:
    """Every phase on a running cluster, then the whole-run invariants."""
    started = time.monotonic()
    out = ChaosSummary(log_dir=str(cluster.log_dir))
    cfg = replace(cfg, storm=replace(cfg.storm, router_url=cluster.router.url))
    for cycle in range(cfg.storm.num_rounds):
        for role in cfg.kill_roles:
            out.phases.append(await kill_phase(cluster, cfg, role, cycle))
        for kind in cfg.graceful:
            out.phases.append(await drain_phase(cluster, cfg, kind, cycle))
    if cfg.prefill_faults or cfg.decode_faults:
        out.phases.append(await faults_phase(cluster, cfg))
    out.invariants.append(traceback_invariant(cluster.target()))
    out.wall_s = round(time.monotonic() - started, 2)
    return out


async def run_chaos(cfg: ChaosConfig, spec: ClusterSpec) -> ChaosSummary:
    """The whole bench on a fresh cluster."""
    async with Cluster(spec) as cluster:
        return await run_phases(cluster, cfg)


def format_chaos(s: ChaosSummary) -> str:
    """The human-readable report: one line per phase, failed invariants, the totals."""
    lines = [f"== chaos: {'OK' if s.is_ok else 'FAILED'} in {s.wall_s:.1f}s"]
    for p in s.phases:
        lines += _format_phase(p)
    lines += [f"  [{'ok' if i.is_ok else 'FAIL'}] {i.name}: {i.detail}" for i in s.invariants]
    num_checks = sum(len(p.summary.invariants) for p in s.phases) + len(s.invariants)
    lines.append(
        f"TOTAL: requests tried {s.total('num_tried')}, aborted by clients "
        f"{s.total('num_aborted_by_client')}, killed peers {s.num_killed_peers}, ended in error "
        f"{s.total('num_errors') + s.total('num_truncated')}, never answered "
        f"{s.total('num_never_answered')}; {num_checks} invariants checked"
    )
    lines.append(f"logs: {s.log_dir}")
    return "\n".join(lines)


def _format_phase(p: PhaseReport) -> list[str]:
    q = p.summary
    line = (
        f"{p.name}: tried {q.num_tried}, completed {q.num_completed}, aborted "
        f"{q.num_aborted_by_client}, errors {q.num_errors}, cut {q.num_truncated}, never "
        f"answered {q.num_never_answered}"
    )
    if p.killed:
        line += f"; killed {p.killed}, back in {p.restart_s}s, rejoined +{p.rejoin_s}s"
    if p.migrations is not None:
        line += f", migrated {p.migrations}"
    if p.faults:
        line += f"; faults {p.faults}"
    if p.cut:
        line += f"; cut {p.cut}'s link, rejoined +{p.rejoin_s}s"
    if p.measured:
        line += "; " + ", ".join(f"{k} {v}" for k, v in p.measured.items())
    lines = [line]
    if q.errors_by_kind:
        lines.append(
            "    errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(q.errors_by_kind.items()))
        )
    lines += [f"    [FAIL] {i.name}: {i.detail}" for i in q.invariants if not i.is_ok]
    return lines


def quick_config(seed: int = 0) -> ChaosConfig:
    """The bounded CI size (``--quick``, 2 decodes): one decode SIGKILLed mid-stream with a
    spare decode and migration on (then restarted), then the faults phase."""
    storm = StormConfig(router_url="", seed=seed, request_rate=CHAOS_RATE, **QUICK)
    return ChaosConfig(storm, kill_roles=("migrate",), graceful=())


def quick_drain_config(seed: int = 0) -> ChaosConfig:
    """The bounded CI size of the graceful phases (``--quick-drain``; run it on 2 prefills and
    2 decodes so that no request may fail): a decode drain, then a rolling restart."""
    storm = StormConfig(router_url="", seed=seed, request_rate=CHAOS_RATE, **QUICK)
    return ChaosConfig(storm, kill_roles=(), graceful=GRACEFUL, prefill_faults=None,
                       decode_faults=None)  # fmt: skip


def link_cut_config(storm: StormConfig) -> ChaosConfig:
    """The link-cut phase: the storm alone, no kills, no fault plans."""
    return ChaosConfig(storm, kill_roles=(), prefill_faults=None, decode_faults=None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_args(p, StormConfig(router_url="", num_rounds=1, request_rate=CHAOS_RATE))
    p.add_argument("--kill", default=",".join(KILL_ROLES), help="roles to kill, in order")
    p.add_argument("--no-faults", action="store_true", help="skip the faults phase")
    p.add_argument("--graceful", default=",".join(GRACEFUL), help="drain/rolling phases, in order")
    p.add_argument("--quick-drain", action="store_true", help="only the graceful phases, CI size")
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument(
        "--link-cut", choices=("decode", "prefill"), default=None,
        help="instead: cut a ROLE host's link under load on network namespaces (root; 2+2 workers)",
    )  # fmt: skip
    p.add_argument("--num-prefill", type=int, default=1)
    args = p.parse_args(argv)
    storm = storm_config_from_args(args, QUICK)
    kill_roles = tuple(r for r in args.kill.split(",") if r)
    if not set(kill_roles) <= set(KILL_ROLES):
        p.error(f"--kill takes roles among {','.join(KILL_ROLES)}")
    graceful = tuple(g for g in args.graceful.split(",") if g)
    if not set(graceful) <= set(GRACEFUL):
        p.error(f"--graceful takes phases among {','.join(GRACEFUL)}")
    cfg = ChaosConfig(storm, kill_roles=("migrate",) if args.quick else kill_roles,
                      graceful=() if args.quick else graceful)  # fmt: skip
    if args.no_faults:
        cfg = replace(cfg, prefill_faults=None, decode_faults=None)
    # The migrate phase needs a spare decode to resume on.
    num_decode = max(args.num_decode, 2) if "migrate" in cfg.kill_roles else args.num_decode
    spec = replace(cluster_spec_from_args(args), num_decode=num_decode,
                   num_prefill=args.num_prefill)  # fmt: skip
    if args.link_cut:
        from bench.chaos_link_cut import run_link_cut  # it builds on this module

        summary = asyncio.run(run_link_cut(link_cut_config(storm), spec, args.link_cut))
    else:
        if args.quick_drain:
            cfg = replace(quick_drain_config(storm.seed), storm=replace(storm, **QUICK))
            spec = replace(
                spec, num_decode=max(2, spec.num_decode), num_prefill=max(2, spec.num_prefill)
            )
        summary = asyncio.run(run_chaos(cfg, spec))
    if args.json:
        print(json.dumps(summary.to_json()))
    else:
        print(format_chaos(summary))
    return 0 if summary.is_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
