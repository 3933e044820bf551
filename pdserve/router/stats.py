"""Plain counters the router keeps; the metrics collector reads them at scrape time."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
)  # fmt: skip


@dataclass
class LatencyHistogram:
    """Bucket counts (non-cumulative) plus sum, exported as a prometheus histogram."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total_s: float = 0.0
    num_samples: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)  # last slot is +Inf

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total_s += seconds
        self.num_samples += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs, ending with ``+Inf``."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


@dataclass
class RouterStats:
    """Written only by the dispatcher, on the event loop."""

    requests_by_status: Counter[str] = field(default_factory=Counter)
    num_retries: int = 0
    num_shed: int = 0  # answered 429 by the admission check
    num_migrations: int = 0  # broken streams resumed on another path
    num_decode_fallbacks: int = 0  # attempts sent to a decode that prefills itself
    num_scoring_on_decode: int = 0  # prompt-scoring attempts a decode served whole
    num_client_disconnects: int = 0
    num_aborts_sent: int = 0
    breaker_opens: Counter[str] = field(default_factory=Counter)  # by worker url
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    first_byte_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
