"""bench/router_overhead.py runs end to end and sends every routed request down both legs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_overhead():
    path = REPO / "bench" / "router_overhead.py"
    spec = importlib.util.spec_from_file_location("bench_router_overhead", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def test_small_overhead_run_reports_both_modes():
    bench = load_overhead()
    cfg = bench.OverheadConfig(num_requests=20, output_len=4, concurrency=2, num_warmup=2)
    res = await bench.run_overhead(cfg)
    assert res["direct"]["num_requests"] == res["router"]["num_requests"] == 20
    assert res["num_prefill_legs"] == 22  # one prefill leg per routed request, warmup included
    assert res["router"]["e2e_p50_ms"] > 0 and "e2e_p99" in res["added_ms"]
    assert "added" in bench.format_report(cfg, res)
