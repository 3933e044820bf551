"""Speculation's Prometheus families, read from :class:`~pdserve.spec.stats.SpecStats` at
scrape time (exported only where speculation is configured; all 0 until a verify step)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.spec.stats import SpecStats


def spec_metrics(role: str, st: SpecStats) -> Iterator[Metric]:
    """accepted / draft_tokens is the acceptance rate; per position, accepted over drafted."""
    counters = {
        "pdserve_spec_decode_verify_steps": ("Verify steps (one forward each)", st.verify_steps),
        "pdserve_spec_decode_drafts": ("Sequences that drafted in a verify step", st.drafts),
        "pdserve_spec_decode_draft_tokens": ("Tokens drafted and verified", st.draft_tokens),
        "pdserve_spec_decode_accepted_tokens": ("Drafted tokens accepted", st.accepted_tokens),
        "pdserve_spec_decode_emitted_tokens": (
            "Tokens verify steps emitted (accepted drafts and the target's next token)",
            st.emitted_tokens,
        ),
        "pdserve_spec_decode_verify_seconds": (
            "Time in verify steps (forward and sampling of every row)", st.verify_seconds
        ),
    }  # fmt: skip
    for name, (doc, value) in counters.items():
        c = CounterMetricFamily(name, doc, labels=["role"])
        c.add_metric([role], value)
        yield c
    for name, doc, values in (
        ("pdserve_spec_decode_drafted_tokens_per_pos", "Drafts that reached this position",
         st.drafted_per_pos),
        ("pdserve_spec_decode_accepted_tokens_per_pos", "Drafts accepted at this position",
         st.accepted_per_pos),
    ):  # fmt: skip
        c = CounterMetricFamily(name, doc, labels=["role", "position"])
        for j, v in enumerate(values):
            c.add_metric([role, str(j)], v)
        yield c
    g = GaugeMetricFamily(
        "pdserve_spec_decode_mean_accepted_length",
        "Accepted drafts per sequence that drafted, since start (0 before any)",
        labels=["role"],
    )
    g.add_metric([role], st.mean_accepted_length)
    yield g
