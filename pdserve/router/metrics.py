"""Prometheus view of the router, built at scrape time from plain stats.

Nothing is created at import: ``build_registry`` makes a registry owned by one Router.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pdserve.router.stats import LatencyHistogram, RouterStats
from pdserve.router.workers import WorkerManager


class RouterCollector(Collector):
    """Reads ``RouterStats`` and the worker registry when scraped."""

    def __init__(self, stats: RouterStats, workers: WorkerManager) -> None:
        self._stats = stats
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        requests = CounterMetricFamily(
            "pdserve_router_requests", "Requests answered by the router", labels=["status"]
        )
        for status, count in sorted(stats.requests_by_status.items()):
            requests.add_metric([status], count)
        yield requests
        yield _counter(
            "pdserve_router_retries", "Attempts retried on another path", stats.num_retries
        )
        yield _counter(
            "pdserve_router_requests_shed",
            "Requests answered 429 at once: no worker could take them soon (router/load.py)",
            stats.num_shed,
        )
        yield _counter(
            "pdserve_router_migrations",
            "Streams that broke mid-answer and were resumed on another path",
            stats.num_migrations,
        )
        yield _counter(
            "pdserve_router_decode_fallbacks",
            "Attempts a decode worker prefilled itself (no prefill worker was available)",
            stats.num_decode_fallbacks,
        )
        yield _counter(
            "pdserve_router_scoring_on_decode",
            "Prompt-scoring attempts (prompt logprobs) a decode worker prefilled and answered",
            stats.num_scoring_on_decode,
        )
        yield _counter(
            "pdserve_router_client_disconnects",
            "Clients that left before their response ended",
            stats.num_client_disconnects,
        )
        yield _counter(
            "pdserve_router_aborts_sent", "Abort calls sent to worker legs", stats.num_aborts_sent
        )
        opens = CounterMetricFamily(
            "pdserve_router_breaker_opens", "Circuit breaker openings", labels=["worker"]
        )
        for url, count in sorted(stats.breaker_opens.items()):
            opens.add_metric([url], count)
        yield opens
        yield from self._worker_gauges()
        yield _histogram(
            "pdserve_router_request_latency_seconds", "End-to-end request latency", stats.latency
        )
        yield _histogram(
            "pdserve_router_first_byte_latency_seconds",
            "Time to the first response byte sent to the client",
            stats.first_byte_latency,
        )

    def _worker_gauges(self) -> Iterator[Metric]:
        labels = ["worker", "role"]
        in_flight = GaugeMetricFamily(
            "pdserve_router_worker_in_flight", "Router-side in-flight requests", labels=labels
        )
        healthy = GaugeMetricFamily(
            "pdserve_router_worker_healthy", "1 when the worker passes health checks", labels=labels
        )
        breaker_open = GaugeMetricFamily(
            "pdserve_router_worker_breaker_open", "1 when the breaker is not closed", labels=labels
        )
        for worker in self._workers.all():
            key = [worker.url, worker.role]
            in_flight.add_metric(key, worker.num_in_flight)
            healthy.add_metric(key, 1 if worker.is_healthy else 0)
            breaker_open.add_metric(key, 0 if worker.breaker.state == "closed" else 1)
        yield in_flight
        yield healthy
        yield breaker_open


def _counter(name: str, doc: str, value: int) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _histogram(name: str, doc: str, hist: LatencyHistogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=hist.cumulative(), sum_value=hist.total_s)


def build_registry(stats: RouterStats, workers: WorkerManager) -> CollectorRegistry:
    """A fresh registry holding only this router's collector."""
    registry = CollectorRegistry()
    registry.register(RouterCollector(stats, workers))
    return registry
