"""bench/chaos_link_cut.py's CI size: a decode host's link cut under a storm on network
namespaces; every request ends, the fleet recovers with nothing restarted. Skipped where the
machine cannot make namespaces."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.abort_storm import StormConfig
from bench.chaos import format_chaos, link_cut_config
from bench.chaos_link_cut import run_link_cut
from bench.cluster import ClusterSpec
from bench.netns import unavailable_reason

pytestmark = pytest.mark.slow


async def test_a_link_cut_under_load_ends_every_request_and_the_fleet_recovers(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    storm = StormConfig(router_url="", seed=7, request_rate=8.0, num_requests=40, concurrency=8,
                        num_rounds=1)  # fmt: skip
    spec = ClusterSpec(model_dir=str(demo_model_dir), log_dir=str(tmp_path / "logs"))
    summary = await run_link_cut(link_cut_config(storm), spec, "decode")
    report = format_chaos(summary)
    print(report)
    assert summary.is_ok, report
    [phase] = summary.phases
    assert phase.cut == "decode-1" and phase.killed is None, report
    assert phase.summary.num_tried >= storm.num_requests, report
    assert phase.summary.num_never_answered == 0, report
    assert phase.summary.num_completed > 0, report
    assert phase.measured["ucx_lanes"] == "tcp/eth0", report
    assert float(phase.measured["kv_transfer_gb_per_s"]) > 0, report
