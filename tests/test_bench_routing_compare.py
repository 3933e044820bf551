"""bench/routing_compare.py: its KV sizing, its hit rates from the workers' counters, and the
ratios it reports (the full run is a benchmark: docs/benchmarks.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import routing_compare as rc  # noqa: E402


def test_the_kv_pool_is_sized_from_the_model_and_the_tokens_to_hold(tmp_path: Path) -> None:
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 256,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 512, "max_position_embeddings": 4096}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf))
    # 2 (K, V) x 4 layers x 2 heads x 64 dims x 2 bytes = 2 KiB a token.
    assert rc.kv_cache_mb(tmp_path, 512) == 1
    assert rc.kv_cache_mb(tmp_path, 9 * 1088) == 19


def test_hit_rates_are_counter_deltas_summed_over_a_role() -> None:
    zero = {rc.HIT: 0.0, rc.QUERY: 0.0, rc.QUERIES: 0.0}
    before = {"prefill-0": zero, "prefill-1": zero, "decode-0": zero}
    after = {
        "prefill-0": {rc.HIT: 300.0, rc.QUERY: 400.0, rc.QUERIES: 2.0},
        "prefill-1": {rc.HIT: 0.0, rc.QUERY: 200.0, rc.QUERIES: 1.0},
        "decode-0": zero,
    }
    assert rc._hit_rate(before, after, "prefill") == pytest.approx(0.5)
    assert rc._hit_rate(before, after, "decode") is None  # nothing looked up


def test_policies_are_checked_and_the_ratios_compare_cache_aware_with_round_robin() -> None:
    with pytest.raises(SystemExit):
        rc.parse_args(["--policies", "round_robin,psychic"])
    assert rc.parse_args([]).policy_list == ["round_robin", "power_of_two", "cache_aware"]
    row = {"decode_hit_rate": 0.1, "ttft_p99_ms": 9.0, "tok_s": 1.0, "req_s": 1.0, "errors": 0,
           "requests_per_prefill": {"prefill-0": 1.0}}  # fmt: skip
    rr = {**row, "policy": "round_robin", "prefill_hit_rate": 0.4, "ttft_p50_ms": 200.0}
    ca = {**row, "policy": "cache_aware", "prefill_hit_rate": 0.8, "ttft_p50_ms": 100.0}
    rows = [rr, ca]
    ratios = rc.report(rows)["ratios"]
    assert ratios["hit_rate_cache_aware_over_round_robin"] == pytest.approx(2.0)
    assert ratios["ttft_p50_cache_aware_over_round_robin"] == pytest.approx(0.5)
