"""Speculation's metrics: exactly 0 before any verify step; afterwards consistent counts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.model_runner import ModelRunner
from pdserve.spec.metrics import spec_metrics
from pdserve.spec.stats import SpecStats

from .harness import both, greedy
from .test_engine_ngram import CODE, NGRAM


def scrape(stats: SpecStats) -> dict[tuple[str, tuple], float]:
    class Collector:
        def collect(self):
            return spec_metrics("colocated", stats)

    reg = CollectorRegistry()
    reg.register(Collector())
    text = generate_latest(reg).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if not s.name.endswith("_created")
    }


def test_every_speculation_metric_is_zero_before_a_verify() -> None:
    values = scrape(SpecStats(4))
    assert values and all(v == 0 for v in values.values())
    names = {name for name, _ in values}
    assert "pdserve_spec_decode_accepted_tokens_total" in names
    assert "pdserve_spec_decode_mean_accepted_length" in names
    positions = [dict(lb)["position"] for n, lb in values
                 if n == "pdserve_spec_decode_accepted_tokens_per_pos_total"]  # fmt: skip
    assert positions == ["0", "1", "2", "3"]


def test_counts_after_a_speculating_request(target: ModelRunner) -> None:
    ids = target.tokenizer.encode(CODE * 3)
    _, seen, stats = both(target, [(ids, greedy(30, ignore_eos=True))], NGRAM)
    assert stats.verify_steps > 0 and 0 < stats.accepted_tokens <= stats.draft_tokens
    assert stats.emitted_tokens <= len(seen[0].ids)  # the prefill's token is not a verify's
    assert sum(stats.accepted_per_pos) == stats.accepted_tokens
    assert sum(stats.drafted_per_pos) == stats.draft_tokens
    v = scrape(stats)
    key = ("pdserve_spec_decode_accepted_tokens_total", (("role", "colocated"),))
    assert v[key] == stats.accepted_tokens
    mean = v[("pdserve_spec_decode_mean_accepted_length", (("role", "colocated"),))]
    assert mean == stats.accepted_tokens / stats.drafts
