"""Prometheus metrics: the KV transfer histograms (names as documented, zero when idle)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.metrics import TransferMetrics

NAMES = (
    "pdserve_kv_transfer_seconds",
    "pdserve_kv_transfer_bytes",
    "pdserve_kv_ready_wait_seconds",
)


def samples(registry: CollectorRegistry) -> dict[tuple[str, float | None], float]:
    """(sample name, bucket bound or None) -> value, for the prefill role."""
    text = generate_latest(registry).decode()
    return {
        (s.name, float(s.labels["le"]) if "le" in s.labels else None): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("role") == "prefill"
    }


def test_transfer_histograms_exist_at_zero_on_an_idle_server() -> None:
    registry = CollectorRegistry()
    TransferMetrics("prefill", registry)
    got = samples(registry)
    for name in NAMES:
        assert got[(f"{name}_count", None)] == 0 and got[(f"{name}_sum", None)] == 0
        assert got[(f"{name}_bucket", float("inf"))] == 0


def test_a_room_lands_in_its_latency_and_bytes_buckets() -> None:
    registry = CollectorRegistry()
    metrics = TransferMetrics("prefill", registry)
    metrics.on_room_sent(0.003, 3 * 4096)
    metrics.on_room_sent(2.0, 64 << 20)
    metrics.on_kv_ready_wait(0.0)
    got = samples(registry)
    assert got[("pdserve_kv_transfer_seconds_count", None)] == 2
    assert got[("pdserve_kv_transfer_seconds_bucket", 0.0025)] == 0
    assert got[("pdserve_kv_transfer_seconds_bucket", 0.005)] == 1
    assert got[("pdserve_kv_transfer_seconds_bucket", 2.5)] == 2
    assert got[("pdserve_kv_transfer_bytes_sum", None)] == 3 * 4096 + (64 << 20)
    assert got[("pdserve_kv_transfer_bytes_bucket", 16384.0)] == 1
    assert got[("pdserve_kv_transfer_bytes_bucket", 64 << 20)] == 2
    assert got[("pdserve_kv_ready_wait_seconds_count", None)] == 1
