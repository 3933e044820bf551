"""bench/gpu_check.py's rehearsal: every step runs on the CPU with small sizes and passes, so
the script is known to work before device time is spent on it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_plan import QUICK

REPO = Path(__file__).resolve().parents[1]
STEPS = ("checkpoint", "bandwidth", "decode_speed", "chunked_prefill", "hf_generate",
         "device_tests", "pd_vs_colocated", "readiness")  # fmt: skip


def test_the_dry_plan_fits_the_8_minute_limit_with_its_margin() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-plan"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:-1]]
    assert tuple(r[0] for r in rows) == STEPS
    total = proc.stdout.splitlines()[-1].split()
    assert total[0] == "total" and float(total[1]) <= 480 - 45
    assert sum(float(r[1]) for r in rows) == float(total[1])


def test_a_plan_over_the_limit_is_refused() -> None:
    from bench.gpu_plan import FULL, plan_problems  # noqa: PLC0415

    over = dataclasses.replace(FULL, budgets_s=(*FULL.budgets_s[:-1], ("readiness", 200.0)))
    assert plan_problems(FULL) == []
    assert "margin" in " ".join(plan_problems(over))
    missing = dataclasses.replace(FULL, budgets_s=FULL.budgets_s[:-1])
    assert "budgets name" in " ".join(plan_problems(missing))


@pytest.mark.slow
def test_quick_cpu_rehearsal_passes_every_step_and_writes_the_json(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--quick", "--out",
         str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=QUICK.total_limit_s + 60,
    )  # fmt: skip
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    failed = {k: v for k, v in report["steps"].items() if v["status"] != "ok"}
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-2000:], proc.stderr[-2000:])
    assert tuple(report["steps"]) == STEPS and report["all_ok"]
    assert all("over_budget" in v and v["budget_s"] > 0 for v in report["steps"].values())
    assert report["environment"]["device"] == "cpu"
    steps = {k: v["result"] for k, v in report["steps"].items()}
    assert steps["device_tests"]["tests"] > 0 and (tmp_path / "device_tests.xml").is_file()
    assert steps["pd_vs_colocated"]["greedy_equal"]
    readiness = steps["readiness"]  # the VRAM transport tests: they skip without CUDA
    expected_skips = 0 if torch.cuda.is_available() else readiness["tests"]
    assert readiness["returncode"] == 0 and readiness["tests"] > 0
    assert readiness["skipped"] == expected_skips
    assert set(steps["pd_vs_colocated"]["pd_serving"]) == {"1", "4"}
    assert steps["bandwidth"]["bytes_per_s"] > 0
    for name in ("decode_speed", "hf_generate"):
        assert set(steps[name]["batches"]) == {"1", "4"}
        assert all(b["step_ms"] > 0 for b in steps[name]["batches"].values())
    assert steps["decode_speed"]["floor_ms"] > 0
    chunked = steps["chunked_prefill"]
    assert chunked["prompt_len"] == 256 and chunked["chunk"] == 64
    assert chunked["whole_prefill_ms"] > 0 and chunked["chunked_total_ms"] > 0
    assert chunked["mixed_step_max_ms"] > 0 and chunked["decode_step_ms"] > 0
