"""Abort storm: concurrent streaming requests through the router, a random fraction of whose
clients hang up at random moments (before the first token or mid-stream), in rounds; then the
invariants that say nothing was forgotten:

- every request ended (tokens + finish_reason, or an error event / error status) within its
  client-side deadline plus slack: *never answered* = 0; no stream cut without ``[DONE]``;
- completed requests carry exactly ``max_tokens`` tokens (usage, ``ignore_eos``);
- after each round, on every worker: queue gauges 0, KV pages free == total, ``/debug/rooms``
  and ``/debug/requests`` empty; the router's ``/debug/requests`` empty;
- no ``Traceback`` in any server log.

Exit status 1 if an invariant fails. Starts its own cluster (demo model) unless given URLs:

    python bench/abort_storm.py --quick
    python bench/abort_storm.py --requests 500 --concurrency 32 --rounds 4 --seed 1 --json
    python bench/abort_storm.py --router-url http://127.0.0.1:30000 \\
        --worker prefill=http://127.0.0.1:30001 --worker decode=http://127.0.0.1:30002
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from anywhere

from bench.cluster import (  # noqa: E402
    Cluster,
    ClusterSpec,
    IdleReport,
    Target,
    check_idle,
    count_tracebacks,
)
from bench.sse import sse_events  # noqa: E402

COMPLETED, ABORTED, ERROR = "completed", "aborted", "error"
NEVER_ANSWERED, TRUNCATED, MALFORMED = "never_answered", "truncated", "malformed"
ABORT_NONE, ABORT_EARLY, ABORT_MID = "none", "before_first_token", "mid_stream"
QUICK = {"num_requests": 100, "concurrency": 12, "num_rounds": 2}  # --quick: the CI size
WORDS = ("alpha", "delta", "kilo", "lima", "oscar", "tango", "zulu", "quartz", "fern", "moss")


@dataclass(frozen=True)
class StormConfig:
    """Size and shape of a storm. ``deadline_s`` is the client's bound on one request (from
    send to end); a request with no end by ``deadline_s + slack_s`` is *never answered*."""

    router_url: str
    model: str = "demo"
    num_requests: int = 100  # per round
    concurrency: int = 16
    num_rounds: int = 2
    request_rate: float | None = None  # Poisson arrivals per second; None: all at once
    seed: int = 0
    abort_fraction: float = 0.3  # of requests, half before the first token, half mid-stream
    max_tokens: int = 24
    max_prompt_words: int = 120
    max_early_abort_s: float = 0.5  # early disconnects happen uniformly within this
    deadline_s: float = 60.0
    slack_s: float = 10.0


@dataclass(frozen=True)
class RequestPlan:
    """One request of a round, drawn from the seed: what to send and when to hang up."""

    request_id: str
    path: str
    body: dict
    max_tokens: int
    abort: str = ABORT_NONE
    abort_after_s: float = 0.0  # ABORT_EARLY: disconnect this long after sending
    abort_after_events: int = 0  # ABORT_MID: disconnect after this many content events


def make_plans(cfg: StormConfig, label: str) -> list[RequestPlan]:
    """Deterministic plans for one round (seed, label) -> same requests, same disconnects.
    ``label`` names the round in request ids (``storm-<seed>-<label>-<i>``: grep the logs)."""
    rng = random.Random(f"{cfg.seed}:{label}")
    plans = []
    for i in range(cfg.num_requests):
        max_tokens = rng.randint(2, cfg.max_tokens)
        prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, cfg.max_prompt_words)))
        common = {"model": cfg.model, "max_tokens": max_tokens, "stream": True,
                  "ignore_eos": True, "temperature": rng.choice([0.0, 0.8]), "seed": i,
                  "stream_options": {"include_usage": True}}  # fmt: skip
        if i % 2:
            path, body = "/v1/completions", {**common, "prompt": prompt}
        else:
            path = "/v1/chat/completions"
            body = {**common, "messages": [{"role": "user", "content": prompt}]}
        abort, after_s, after_events = ABORT_NONE, 0.0, 0
        if rng.random() < cfg.abort_fraction:
            if rng.random() < 0.5:
                abort, after_s = ABORT_EARLY, rng.uniform(0.0, cfg.max_early_abort_s)
            else:
                abort, after_events = ABORT_MID, rng.randint(1, max(1, max_tokens - 1))
        rid = f"storm-{cfg.seed}-{label}-{i}"
        plans.append(RequestPlan(rid, path, body, max_tokens, abort, after_s, after_events))
    return plans


@dataclass
class RequestResult:
    request_id: str
    abort: str
    max_tokens: int
    outcome: str = NEVER_ANSWERED
    status: int | None = None
    error_kind: str = ""
    num_events: int = 0
    num_usage_tokens: int | None = None
    finish_reason: str | None = None
    saw_done: bool = False
    elapsed_s: float = 0.0


class StormProgress:
    """Counters of a running round, with awaitable conditions (the chaos bench kills a peer
    once enough requests are in flight). Written by the round's tasks, on the loop."""

    def __init__(self) -> None:
        self.num_sent = 0
        self.num_streaming = 0  # got their first event
        self.num_ended = 0
        self._waiters: list[tuple[Callable[[StormProgress], bool], asyncio.Future[None]]] = []

    def bump(self, counter: str) -> None:
        setattr(self, counter, getattr(self, counter) + 1)
        for pred, fut in list(self._waiters):
            if not fut.done() and pred(self):
                fut.set_result(None)

    async def wait_for(self, pred: Callable[[StormProgress], bool], max_wait_s: float) -> bool:
        """True once ``pred(self)`` holds; False if it did not within ``max_wait_s``."""
        if pred(self):
            return True
        fut = asyncio.get_running_loop().create_future()
        entry = (pred, fut)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(fut, max_wait_s)
            return True
        except TimeoutError:
            return False
        finally:
            self._waiters.remove(entry)


async def run_round(
    session: aiohttp.ClientSession, cfg: StormConfig, label: str, progress: StormProgress
) -> list[RequestResult]:
    """Every request of one round, at most ``cfg.concurrency`` at a time, arriving at
    ``cfg.request_rate`` (so a round spans a kill and the restart after it)."""
    gate = asyncio.Semaphore(cfg.concurrency)
    plans = make_plans(cfg, label)
    offsets = arrival_offsets(cfg, label, len(plans))

    async def gated(plan: RequestPlan, offset_s: float) -> RequestResult:
        await asyncio.sleep(offset_s)  # the arrival schedule, not a synchronisation
        async with gate:
            return await run_request(session, cfg, plan, progress)

    return await asyncio.gather(*(gated(p, t) for p, t in zip(plans, offsets, strict=True)))


def arrival_offsets(cfg: StormConfig, label: str, n: int) -> list[float]:
    """Seconds from the round's start to each request's arrival (all 0 without a rate)."""
    if not cfg.request_rate:
        return [0.0] * n
    rng = random.Random(f"{cfg.seed}:{label}:arrivals")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(cfg.request_rate)
    return out


async def run_request(
    session: aiohttp.ClientSession, cfg: StormConfig, plan: RequestPlan, progress: StormProgress
) -> RequestResult:
    """Send one streaming request, hang up as planned, classify how it ended."""
    result = RequestResult(plan.request_id, plan.abort, plan.max_tokens)
    started = time.monotonic()
    progress.bump("num_sent")
    task = asyncio.create_task(_exchange(session, cfg, plan, result, progress))
    try:
        limit = cfg.deadline_s + cfg.slack_s
        if plan.abort == ABORT_EARLY:
            limit = min(limit, plan.abort_after_s)
        done, _ = await asyncio.wait({task}, timeout=limit)
        if not done:
            task.cancel()  # closes the connection: the router sees its client leave
            await asyncio.gather(task, return_exceptions=True)
            result.outcome = ABORTED if plan.abort == ABORT_EARLY else NEVER_ANSWERED
        elif task.exception() is not None:  # an answer this client could not make sense of
            result.outcome = MALFORMED
            result.error_kind = f"client:{type(task.exception()).__name__}"
    finally:
        task.cancel()
        result.elapsed_s = round(time.monotonic() - started, 4)
        progress.bump("num_ended")
    return result


async def _exchange(
    session: aiohttp.ClientSession,
    cfg: StormConfig,
    plan: RequestPlan,
    result: RequestResult,
    progress: StormProgress,
) -> None:
    headers = {"X-Request-Id": plan.request_id}
    try:
        async with session.post(
            cfg.router_url + plan.path, json=plan.body, headers=headers
        ) as resp:
            result.status = resp.status
            if resp.status != 200:
                _classify_error_body(result, await resp.read())
                return
            await _read_stream(resp, plan, result, progress)
    except (aiohttp.ClientError, ConnectionError) as e:
        # A peer died under us (the chaos bench kills the router): a clear end, as an error.
        result.outcome = TRUNCATED if result.num_events else ERROR
        result.error_kind = f"connection:{type(e).__name__}"


def _classify_error_body(result: RequestResult, raw: bytes) -> None:
    try:
        error = orjson.loads(raw)["error"]
        code = error.get("code") or error.get("type")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        result.outcome, result.error_kind = MALFORMED, f"http_{result.status}:not-openai"
        return
    result.outcome, result.error_kind = ERROR, f"http_{result.status}:{code}"


async def _read_stream(
    resp: aiohttp.ClientResponse, plan: RequestPlan, result: RequestResult, progress: StormProgress
) -> None:
    async for event in sse_events(resp):
        payload = event.data
        if payload is None:
            result.saw_done = True
            break
        if "error" in payload:
            err = payload["error"] or {}
            result.error_kind = f"sse:{err.get('code') or err.get('type')}"
            continue
        if payload.get("usage"):
            result.num_usage_tokens = payload["usage"].get("completion_tokens")
        for choice in payload.get("choices") or []:
            result.finish_reason = choice.get("finish_reason") or result.finish_reason
        result.num_events += 1
        if result.num_events == 1:
            progress.bump("num_streaming")
        is_due = plan.abort == ABORT_MID and result.num_events >= plan.abort_after_events
        if is_due and result.finish_reason is None:
            resp.close()  # hang up mid-stream
            result.outcome = ABORTED
            return
    result.outcome = _stream_outcome(result)


def _stream_outcome(r: RequestResult) -> str:
    if not r.saw_done:
        return TRUNCATED
    if r.error_kind:
        return ERROR
    return COMPLETED if r.finish_reason is not None else MALFORMED


@dataclass
class Invariant:
    name: str
    is_ok: bool
    detail: str = ""


@dataclass
class StormSummary:
    """Counts over every request of a run, and the invariants that were checked."""

    num_tried: int = 0
    num_completed: int = 0
    num_aborted_by_client: int = 0
    num_errors: int = 0
    num_never_answered: int = 0
    num_truncated: int = 0
    num_malformed: int = 0
    num_wrong_length: int = 0
    max_end_s: float = 0.0
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    invariants: list[Invariant] = field(default_factory=list)
    log_dir: str | None = None
    wall_s: float = 0.0

    @property
    def is_ok(self) -> bool:
        return all(i.is_ok for i in self.invariants)

    def add(self, results: list[RequestResult]) -> None:
        for r in results:
            self.num_tried += 1
            self.max_end_s = max(self.max_end_s, r.elapsed_s)
            attr = _COUNTER_BY_OUTCOME[r.outcome]
            setattr(self, attr, getattr(self, attr) + 1)
            if r.error_kind:
                self.errors_by_kind[r.error_kind] = self.errors_by_kind.get(r.error_kind, 0) + 1
            if r.outcome == COMPLETED and r.num_usage_tokens != r.max_tokens:
                self.num_wrong_length += 1

    def to_json(self) -> dict:
        return {**asdict(self), "is_ok": self.is_ok}


_COUNTER_BY_OUTCOME = {
    COMPLETED: "num_completed",
    ABORTED: "num_aborted_by_client",
    ERROR: "num_errors",
    NEVER_ANSWERED: "num_never_answered",
    TRUNCATED: "num_truncated",
    MALFORMED: "num_malformed",
}


def request_invariants(s: StormSummary, *, allow_truncated: bool = False) -> list[Invariant]:
    """What the clients saw: every request ended, cleanly."""
    checks = [
        Invariant("never answered = 0", s.num_never_answered == 0, f"{s.num_never_answered}"),
        Invariant("malformed answers = 0", s.num_malformed == 0, f"{s.num_malformed}"),
        Invariant("completed with all tokens", s.num_wrong_length == 0, f"{s.num_wrong_length}"),
    ]
    if not allow_truncated:
        checks.append(Invariant("streams cut without [DONE] = 0", s.num_truncated == 0,
                                f"{s.num_truncated}"))  # fmt: skip
    return checks


def idle_invariants(report: IdleReport, label: str) -> list[Invariant]:
    """What the servers say once the dust settled: nothing left anywhere."""
    out = []
    for w in report.workers:
        busy = {k.removeprefix("pdserve_"): v for k, v in w.queues.items() if v != 0}
        detail = (
            w.error
            or f"queues {busy or 0}, pages {w.pages_free:g}/{w.pages_total:g}, "
            f"rooms {w.num_debug_rooms}, requests {w.num_debug_requests}"
        )
        out.append(Invariant(f"{label}: {w.name} idle", w.is_idle, detail))
    out.append(Invariant(f"{label}: router /debug/requests empty", report.num_router_requests == 0,
                         f"{report.num_router_requests}"))  # fmt: skip
    return out


def traceback_invariant(target: Target) -> Invariant:
    counts = count_tracebacks(target.log_paths)
    bad = {k: v for k, v in counts.items() if v}
    return Invariant("no Traceback in server logs", not bad, f"{bad or len(counts)} logs clean")


async def run_storm(
    session: aiohttp.ClientSession,
    target: Target,
    cfg: StormConfig,
    *,
    max_idle_wait_s: float = 30.0,
) -> StormSummary:
    """``cfg.num_rounds`` rounds; the servers must be idle after each. Returns the summary."""
    started = time.monotonic()
    summary = StormSummary()
    for round_no in range(cfg.num_rounds):
        results = await run_round(session, cfg, str(round_no), StormProgress())
        summary.add(results)
        report = await check_idle(session, target, max_idle_wait_s)
        summary.invariants += idle_invariants(report, f"round {round_no}")
    summary.invariants = request_invariants(summary) + summary.invariants
    summary.invariants.append(traceback_invariant(target))
    summary.wall_s = round(time.monotonic() - started, 2)
    return summary


async def run_abort_storm(
    cfg: StormConfig, spec: ClusterSpec | None = None, target: Target | None = None
) -> StormSummary:
    """The whole bench: on ``target`` when given, else on a fresh cluster from ``spec``."""
    if target is not None:
        connector = aiohttp.TCPConnector(force_close=True)  # a hang-up closes its connection
        async with aiohttp.ClientSession(connector=connector) as session:
            return await run_storm(session, target, cfg)
    assert spec is not None
    async with Cluster(spec) as cluster:
        cfg = StormConfig(**{**asdict(cfg), "router_url": cluster.router.url})
        summary = await run_storm(cluster.session, cluster.target(), cfg)
        summary.log_dir = str(cluster.log_dir)
    return summary


def format_summary(s: StormSummary, title: str = "abort storm") -> str:
    """The human-readable report: counts, errors by kind, every invariant."""
    lines = [
        f"== {title}: {'OK' if s.is_ok else 'FAILED'} in {s.wall_s:.1f}s",
        f"requests tried {s.num_tried}, completed {s.num_completed}, aborted by clients "
        f"{s.num_aborted_by_client}, ended in error {s.num_errors}, cut {s.num_truncated}, "
        f"never answered {s.num_never_answered}; slowest end {s.max_end_s:.2f}s",
    ]
    if s.errors_by_kind:
        lines.append(
            "errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(s.errors_by_kind.items()))
        )
    lines += [f"  [{'ok' if i.is_ok else 'FAIL'}] {i.name}: {i.detail}" for i in s.invariants]
    if s.log_dir:
        lines.append(f"logs: {s.log_dir}")
    return "\n".join(lines)


def quick_config(router_url: str = "", seed: int = 0) -> StormConfig:
    """The bounded CI size (``--quick``): 2 rounds of 100 requests, 12 at a time."""
    return StormConfig(router_url=router_url, seed=seed, **QUICK)


def add_size_args(p: argparse.ArgumentParser, defaults: StormConfig) -> None:
    """The flags both benches share: size, seed, deadlines, output, cluster model."""
    p.add_argument("--requests", type=int, default=defaults.num_requests, help="per round")
    p.add_argument("--concurrency", type=int, default=defaults.concurrency)
    p.add_argument("--rounds", type=int, default=defaults.num_rounds)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--rate", type=float, default=defaults.request_rate, help="requests/s")
    p.add_argument("--abort-fraction", type=float, default=defaults.abort_fraction)
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    p.add_argument("--deadline", type=float, default=defaults.deadline_s, help="per request, s")
    p.add_argument("--quick", action="store_true", help="the bounded CI size")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    p.add_argument("--model", default=None, help="model dir (default: the built-in demo)")
    p.add_argument("--served-model-name", default=defaults.model, help="the requests' model")
    p.add_argument("--log-dir", default=None, help="default: a fresh temp dir")


def storm_config_from_args(args: argparse.Namespace, quick: dict[str, int]) -> StormConfig:
    sizes = {"num_requests": args.requests, "concurrency": args.concurrency,
             "num_rounds": args.rounds}  # fmt: skip
    if args.quick:
        sizes = quick
    return StormConfig(
        router_url=getattr(args, "router_url", None) or "",
        model=args.served_model_name,
        seed=args.seed,
        request_rate=args.rate,
        abort_fraction=args.abort_fraction,
        max_tokens=args.max_tokens,
        deadline_s=args.deadline,
        **sizes,
    )


def cluster_spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    from pdserve.cli_common import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model))
    return ClusterSpec(model_dir, served_model_name=args.served_model_name, log_dir=args.log_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_args(p, StormConfig(router_url=""))
    p.add_argument("--router-url", default=None, help="target a running cluster instead")
    p.add_argument("--worker", action="append", default=[], metavar="NAME=URL")
    p.add_argument("--log-file", action="append", default=[], help="server logs to check")
    args = p.parse_args(argv)
    cfg = storm_config_from_args(args, QUICK)
    target = None
    if args.router_url:
        workers = dict(w.split("=", 1) for w in args.worker)
        target = Target(args.router_url, workers, tuple(Path(f) for f in args.log_file))
    spec = None if target else cluster_spec_from_args(args)
    summary = asyncio.run(run_abort_storm(cfg, spec, target))
    if args.json:
        print(json.dumps(summary.to_json()))
    else:
        print(format_summary(summary))
    return 0 if summary.is_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
