"""bench/structured_bench.py end to end at its --quick size: every figure it reports is measured."""

from __future__ import annotations

import json
import math

import pytest

from bench import structured_bench


@pytest.mark.slow
def test_quick_run_reports_finite_step_and_tpot_figures_for_every_case(capsys) -> None:
    assert structured_bench.main(["--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    server = result["server"]
    for case in ("alone", "next_to_unconstrained", "next_to_constrained"):
        # The decode step comes from /metrics deltas: a case that ran no decode step is NaN.
        for figure in (f"tpot_ms_{case}", f"decode_step_ms_{case}"):
            assert math.isfinite(server[figure]) and server[figure] > 0, figure
    assert result["runner"]["step_ms_all_constrained"] > 0
