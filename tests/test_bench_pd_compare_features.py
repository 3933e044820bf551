"""bench/pd_compare.py --features: pdserve's deployments once with SSE keep-alive and priority
scheduling off, once on, in the same run, and the on / off ratio of each (issue 32's goal)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import pd_compare  # noqa: E402


def parsed(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    seen: list[argparse.Namespace] = []

    async def fake_run_all(args: argparse.Namespace) -> list[dict]:
        seen.append(args)
        return []

    monkeypatch.setattr(pd_compare, "run_all", fake_run_all)
    assert pd_compare.main(argv) == 0
    return seen[0]


def test_features_off_and_on_are_the_variants_run(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parsed(["--features", "off,on", "--keepalive-s", "0.5"], monkeypatch)
    assert args.feature_variants == ["off", "on"] and args.keepalive_s == 0.5
    assert parsed([], monkeypatch).feature_variants == []  # the servers' defaults
    with pytest.raises(SystemExit):
        pd_compare.main(["--features", "sometimes"])


def test_each_variant_sets_keep_alive_and_the_policy_on_workers_and_router() -> None:
    assert pd_compare.feature_args(None, 15.0) == ((), ())
    workers, router = pd_compare.feature_args("off", 15.0)
    assert workers == ("--sse-keepalive-s", "0", "--scheduling-policy", "fcfs")
    assert router == ("--sse-keepalive-s", "0")
    workers, router = pd_compare.feature_args("on", 0.5)
    assert workers == ("--sse-keepalive-s", "0.5", "--scheduling-policy", "priority")
    assert router == ("--sse-keepalive-s", "0.5")


def test_the_report_keeps_the_variants_and_prints_their_ratio() -> None:
    def summary(tok_s: float) -> dict:
        return {"output_throughput": tok_s, "ttft_ms": {"p50": 10.0}, "tpot_ms": {"p50": 1.0}}

    results = {"pd:off": {8: summary(100.0)}, "pd:on": {8: summary(98.0)}}
    rows = pd_compare.report("small", results, [8])
    assert [r["deployment"] for r in rows] == ["pd:off", "pd:on"]
    [line] = pd_compare.feature_lines(rows)
    assert line.startswith("small c8: pd keep-alive+priority on / off throughput, same run: 0.980")
