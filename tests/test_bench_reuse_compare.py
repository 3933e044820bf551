"""bench/reuse_compare.py measures prefix caching (colocated with and without it, PD with the
KV bytes it sends) and chunked prefill (running streams' gaps while a long prompt prefills):
each scenario runs end to end at a tiny size on the demo model and writes every figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import reuse_compare  # noqa: E402
from bench.timed_stream import Stream, has_outlasted, window_itls  # noqa: E402
from bench.vllm_ref import VllmServer  # noqa: E402

TINY = [
    "--worker-args", "--kv-cache-mb 64 --num-threads 1", "--request-timeout", "60",
    "--num-prefixes", "2", "--prefix-len", "64", "--input-len", "16", "--output-len", "8",
    "--num-requests", "4", "--concurrency", "2",
    "--num-streams", "2", "--stream-input-len", "16", "--stream-output-len", "48",
    "--long-len", "256", "--max-num-batched-tokens", "64",
]  # fmt: skip


def test_window_itls_counts_every_gap_that_overlaps_the_prefill_window() -> None:
    s = Stream(token_times=[0.0, 1.0, 5.0, 6.0, 7.0])  # a stall from 1 to 5
    # The long prompt arrives at 2 and gets its first token at 4: only the stall overlaps.
    assert window_itls([s], 2.0, 4.0) == [4.0]
    assert sorted(window_itls([s], 0.5, 5.5)) == [1.0, 1.0, 4.0]
    assert window_itls([Stream(token_times=[3.0])], 0.0, 9.0) == []


def test_a_stream_outlasts_another_once_that_one_has_its_first_token_or_ended() -> None:
    long = Stream()
    assert not has_outlasted(long, 5.0)  # still prefilling
    long.token_times.append(4.0)
    assert not has_outlasted(long, 4.0) and has_outlasted(long, 4.5)
    assert has_outlasted(Stream(is_done=True), 0.0)  # it failed: nothing to wait for


def test_vllm_reference_keeps_prefix_caching_off_unless_asked(tmp_path: Path) -> None:
    off = VllmServer(sys.executable, tmp_path, 1).argv()
    on = VllmServer(sys.executable, tmp_path, 1, prefix_caching=True).argv()
    assert "--no-enable-prefix-caching" in off  # pd_compare's default
    assert "--no-enable-prefix-caching" not in on


def test_long_prompt_budgets_are_a_comma_list_of_positive_token_counts() -> None:
    args = reuse_compare.parse_args(["--max-num-batched-tokens", "64,512"])
    assert args.max_num_batched_tokens == [64, 512]
    for bad in ("64,x", "0", ""):
        with pytest.raises(SystemExit):
            reuse_compare.parse_args(["--max-num-batched-tokens", bad])


def test_vllm_deployment_needs_its_python() -> None:
    with pytest.raises(SystemExit):
        reuse_compare.parse_args(["--deployments", "colocated,vllm"])


@pytest.mark.slow
def test_both_scenarios_run_on_the_demo_model_and_report_positive_figures(
    tmp_path: Path,
) -> None:
    out = tmp_path / "reuse.json"
    argv = ["--deployments", "colocated,colocated-nocache,pd", "--json-out", str(out), *TINY]
    assert reuse_compare.main(argv) == 0
    report = json.loads(out.read_text())

    rows = {r["deployment"]: r for r in report["shared_prefix"]["rows"]}
    assert set(rows) == {"colocated", "colocated-nocache", "pd"}
    for row in rows.values():
        assert row["errors"] == 0
        for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tok_s"):
            assert row[key] > 0, (row["deployment"], key)
    # 4 requests over 2 prefixes: the second of each group finds its prefix cached.
    assert rows["colocated"]["prefix_cache_hit_rate"] > 0
    assert rows["pd"]["prefix_cache_hit_rate"] > 0
    assert rows["colocated-nocache"]["prefix_cache_hit_rate"] == 0
    assert rows["pd"]["kv_bytes_sent_per_request"] > 0
    assert rows["colocated"]["kv_bytes_sent_per_request"] is None
    assert report["shared_prefix"]["ratios"]["ttft_nocache_over_cache_colocated"] > 0

    runs = report["long_prompt"]["runs"]
    assert set(runs) == {"chunked", "unchunked"}
    for run in runs.values():
        assert run["long_len"] == 256
        # Every stream ran until after the long prompt's first token, by construction.
        assert run["streams_running_after_first_token"] == 2
        assert run["num_window_itls"] >= 2  # so each has a gap overlapping its prefill
        for key in ("long_ttft_ms", "window_itl_p50_ms", "window_itl_p99_ms", "all_itl_p50_ms"):
            assert run[key] > 0, key
    assert runs["chunked"]["max_num_batched_tokens"] == 64
    assert report["long_prompt"]["ratios"]["ttft_chunked_over_unchunked"] > 0
