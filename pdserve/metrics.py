"""Prometheus metrics of one server. Everything lives in the server's own registry (no globals).

Latencies and counts are observed as they happen (EngineObserver hooks); queue sizes, pages and room
states are read from their owners at scrape time, so an idle server shows exactly zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.engine.request import Request, RequestState
from pdserve.engine.stats import EngineObserver
from pdserve.spec.metrics import spec_metrics
from pdserve.transport.observer import TransferObserver

if TYPE_CHECKING:
    from pdserve.engine.cpu_lease import LeaseStats
    from pdserve.engine.engine import Engine
    from pdserve.fsm import RoomTable
    from pdserve.model_runner import ModelRunner

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
                    5.12, 10.24, 20.48, 40.96, 81.92)  # fmt: skip

# KV transfers of one room: a few hundred microseconds (a small room over shared memory) to
# seconds (a long prompt over TCP); bytes per room: one 4 KiB page to several GiB.
_TRANSFER_BUCKETS = (0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0)  # fmt: skip
_BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(1, 13))  # 4 KiB .. 16 GiB

# Engine request states -> the gauge names the operators' dashboards use.
_QUEUE_GAUGES = {
    RequestState.WAITING: ("pdserve_waiting_requests", "Requests queued for prefill"),
    RequestState.PREFILLING: (
        "pdserve_prefilling_requests",
        "Requests whose prompt is being prefilled (pages held, chunks computing)",
    ),
    RequestState.RUNNING: ("pdserve_running_requests", "Requests in the decode batch"),
    RequestState.PREFILL_INFLIGHT: (
        "pdserve_prefill_inflight_requests",
        "Prefill done, KV hand-off not final",
    ),
    RequestState.WAITING_FOR_KV: (
        "pdserve_decode_waiting_for_kv_requests",
        "Decode requests whose KV has not arrived",
    ),
}


class PrometheusObserver(EngineObserver):
    def __init__(self, role: str, registry: CollectorRegistry) -> None:
        self.role = role
        labels = ["role"]
        self.requests = Counter(
            "pdserve_requests", "Finished requests by status", ["role", "status"], registry=registry
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens admitted", labels, registry=registry
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Tokens generated", labels, registry=registry
        )
        self.aborts = Counter("pdserve_aborts", "Requests aborted", labels, registry=registry)
        self.timeouts = Counter(
            "pdserve_request_timeouts", "Request deadlines fired", ["role", "state"],
            registry=registry,
        )  # fmt: skip
        hist = dict(buckets=_LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds", "Time to first token", labels, **hist
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds", "Time between tokens", labels, **hist
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds", "Request latency", labels, **hist
        )
        # Per-token children resolved once: a label lookup costs ~15 us, paid per token otherwise.
        self._generation_tokens = self.generation_tokens.labels(role)
        self._itl = self.itl.labels(role)

    def on_arrival(self, req: Request) -> None:
        self.prompt_tokens.labels(self.role).inc(req.seq.num_prompt_tokens)

    def on_tokens(self, req: Request, num_tokens: int) -> None:
        super().on_tokens(req, num_tokens)
        self._generation_tokens.inc(num_tokens)

    def on_first_token(self, req: Request, ttft_s: float) -> None:
        self.ttft.labels(self.role).observe(ttft_s)

    def on_inter_token(self, req: Request, itl_s: float) -> None:
        self._itl.observe(itl_s)

    def on_abort(self, req: Request) -> None:
        self.aborts.labels(self.role).inc()

    def on_timeout(self, req: Request, label: str) -> None:
        self.timeouts.labels(self.role, req.state.value).inc()

    def on_finish(self, req: Request, status: str) -> None:
        self.requests.labels(self.role, status).inc()
        if req.last_token_at is not None:
            self.e2e.labels(self.role).observe(req.last_token_at - req.arrival)


class TransferMetrics(TransferObserver):
    """KV transfers of a prefill worker's sender, observed as each room's last write lands."""

    def __init__(self, role: str, registry: CollectorRegistry) -> None:
        labels = ["role"]
        # Children resolved now: every series exists (at 0) on a server that never sent a room.
        self.seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "KV transfer time of a room: first WRITE posted to last WRITE done",
            labels, buckets=_TRANSFER_BUCKETS, registry=registry,
        ).labels(role)  # fmt: skip
        self.bytes = Histogram(
            "pdserve_kv_transfer_bytes", "KV bytes written per room", labels,
            buckets=_BYTES_BUCKETS, registry=registry,
        ).labels(role)  # fmt: skip
        self.ready_wait = Histogram(
            "pdserve_kv_ready_wait_seconds",
            "Time a room's first WRITE waited for the prefill's KV writes to finish on the device",
            labels, buckets=_TRANSFER_BUCKETS, registry=registry,
        ).labels(role)  # fmt: skip

    def on_room_sent(self, seconds: float, num_bytes: int) -> None:
        self.seconds.observe(seconds)
        self.bytes.observe(num_bytes)

    def on_kv_ready_wait(self, seconds: float) -> None:
        self.ready_wait.observe(seconds)


class EngineCollector:
    """Reads gauges from the engine, its page allocator and room table at scrape time."""

    def __init__(
        self,
        engine: Engine,
        rooms: Callable[[], RoomTable | None],
        transport_stats: Callable[[], dict[str, Any]],
    ) -> None:
        self.engine = engine
        self.rooms = rooms
        self.transport_stats = transport_stats

    def collect(self) -> Iterator[Metric]:
        role = self.engine.config.role
        counts = self.engine.count_by_state()
        for state, (name, doc) in _QUEUE_GAUGES.items():
            yield _gauge(name, doc, role, counts[state.value])
        alloc = self.engine.allocator
        yield _gauge("pdserve_kv_pages_total", "KV cache pages", role, alloc.num_pages)
        yield _gauge("pdserve_kv_pages_free", "Free KV cache pages", role, alloc.num_free)
        yield _gauge(
            "pdserve_kv_pages_used", "KV pages referenced by requests", role, alloc.num_used
        )
        yield _gauge(
            "pdserve_kv_pages_cached",
            "Unreferenced KV pages holding cached prefixes (evicted when pages run out); "
            "idle: free + cached == total",
            role, alloc.num_cached,
        )  # fmt: skip
        yield from _prefix_cache_metrics(role, self.engine)
        yield from self._ages(role)
        yield from _runner_metrics(role, self.engine.runner)
        speculator = self.engine.steps.speculator
        if speculator is not None:
            yield from spec_metrics(role, speculator.stats)
        lease = self.engine.cpu_lease
        if lease is not None:
            yield from _lease_metrics(role, lease.stats)
        table = self.rooms()
        if table is not None:
            yield from _room_metrics(role, table)
        yield from _transport_metrics(role, self.transport_stats())

    def _ages(self, role: str) -> Iterator[Metric]:
        g = GaugeMetricFamily(
            "pdserve_oldest_nonterminal_age_seconds",
            "Oldest live request (time in its current state) or room (age since created), by state",
            labels=["role", "state"],
        )
        for state, age in self.engine.oldest_age_by_state().items():
            g.add_metric([role, f"request:{state}"], age)
        table = self.rooms()
        if table is not None:
            for state, age in table.oldest_age_by_state().items():
                g.add_metric([role, f"room:{state}"], age)
        yield g


def _gauge(name: str, doc: str, role: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["role"])
    g.add_metric([role], value)
    return g


def _runner_metrics(role: str, runner: ModelRunner) -> Iterator[Metric]:
    """Model steps: rate(step_seconds) is the runner thread's busy fraction; with steps and
    tokens it gives the mean step time and batch size of each phase."""
    st = runner.stats
    per_phase = {
        "pdserve_model_steps": ("Model forward calls", st.num_prefill_calls, st.num_decode_steps),
        "pdserve_model_tokens": (
            "Tokens computed by model forwards", st.num_prefill_tokens, st.num_decode_tokens
        ),
        "pdserve_model_step_seconds": (
            "Time in model forwards (batch building, forward, sampling)",
            st.prefill_seconds, st.decode_seconds,
        ),
    }  # fmt: skip
    for name, (doc, prefill, decode) in per_phase.items():
        c = CounterMetricFamily(name, doc, labels=["role", "phase"])
        c.add_metric([role, "prefill"], prefill)
        c.add_metric([role, "decode"], decode)
        yield c
    g = GaugeMetricFamily(
        "pdserve_torch_threads", "torch threads per phase", labels=["role", "phase"]
    )
    g.add_metric([role, "prefill"], runner.prefill_threads)
    g.add_metric([role, "decode"], runner.decode_threads)
    yield g


def _prefix_cache_metrics(role: str, engine: Engine) -> Iterator[Metric]:
    """hit_tokens / query_tokens is the prefix cache's token hit rate."""
    st = engine.prefix_cache.stats
    per_name = {
        "pdserve_prefix_cache_queries": ("Prefill admissions that looked up the prefix cache",
                                         st.num_queries),
        "pdserve_prefix_cache_query_tokens": ("Tokens of the prompts looked up", st.query_tokens),
        "pdserve_prefix_cache_hit_tokens": ("Tokens found cached (not computed)", st.hit_tokens),
        "pdserve_kv_page_evictions": ("Cached KV pages evicted to make room",
                                      engine.allocator.num_evictions),
    }  # fmt: skip
    for name, (doc, value) in per_name.items():
        c = CounterMetricFamily(name, doc, labels=["role"])
        c.add_metric([role], value)
        yield c
    c = CounterMetricFamily(
        "pdserve_preemptions", "Running requests preempted (their KV freed or kept cached, "
        "recomputed later), by cause: out_of_pages or priority", labels=["role", "cause"],
    )  # fmt: skip
    for cause, n in engine.scheduler.stats.num_preemptions.items():
        c.add_metric([role, cause], n)
    yield c


def _lease_metrics(role: str, st: LeaseStats) -> Iterator[Metric]:
    """Turns at cores shared with other workers: rate(wait_seconds) is the step-time fraction
    spent waiting for them; timeouts count steps that ran without the lease."""
    per_name = {
        "pdserve_cpu_lease_wait_seconds": ("Time model steps waited for the CPU lease",
                                           st.wait_seconds),
        "pdserve_cpu_lease_contended_steps": ("Model steps that waited for the CPU lease",
                                              st.contended),
        "pdserve_cpu_lease_timeouts": ("Model steps run without the CPU lease after its timeout",
                                       st.timeouts),
    }  # fmt: skip
    for name, (doc, value) in per_name.items():
        c = CounterMetricFamily(name, doc, labels=["role"])
        c.add_metric([role], value)
        yield c


def _room_metrics(role: str, table: RoomTable) -> Iterator[Metric]:
    g = GaugeMetricFamily("pdserve_rooms", "Live KV rooms by state", labels=["role", "state"])
    for state, n in table.count_by_state().items():
        g.add_metric([role, str(state)], n)
    yield g
    stats = table.stats
    rej = CounterMetricFamily(
        "pdserve_fsm_rejected_transitions",
        "Room triggers refused because they were invalid in the room's state (counted no-ops)",
        labels=["role", "trigger", "state"],
    )
    for (trigger, state), n in sorted(stats.rejected.items()):
        rej.add_metric([role, trigger, str(state)], n)
    yield rej
    to = CounterMetricFamily(
        "pdserve_room_timeouts", "Room deadlines fired, by state", labels=["role", "state"]
    )
    for state, n in sorted(stats.timeouts_by_state.items()):
        to.add_metric([role, str(state)], n)
    yield to
    ended = CounterMetricFamily(
        "pdserve_rooms_ended", "Rooms that reached a final state", labels=["role", "outcome"]
    )
    ended.add_metric([role, "Success"], stats.succeeded)
    for reason, n in sorted(stats.failed_by_reason.items()):
        ended.add_metric([role, f"Failed:{reason}"], n)
    yield ended


def _transport_metrics(role: str, stats: dict[str, Any]) -> Iterator[Metric]:
    """Transport stats: ``num_*``/``peak_*`` are levels (gauges), everything else only grows."""
    for key, value in sorted(stats.items()):
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        name = f"pdserve_transport_{key}"
        if key.startswith(("num_", "peak_")):
            m: Metric = GaugeMetricFamily(name, f"KV transport level {key}", labels=["role"])
        else:
            m = CounterMetricFamily(name, f"KV transport counter {key}", labels=["role"])
        m.add_metric([role], value)
        yield m
