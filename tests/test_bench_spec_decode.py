"""bench/spec_decode.py runs end to end on the demo pair at a tiny size: every method's outputs
are checked against plain ones, and every figure is written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import spec_decode  # noqa: E402


def test_the_bench_checks_identity_and_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    code = spec_decode.main([
        "--demo", "--workload", "edit", "--edit-chars", "300", "--num-requests", "1",
        "--output-len", "8", "--concurrency", "1,2", "--worker-args",
        "--kv-cache-mb 64 --num-threads 1", "--verify-cost", "--verify-context", "32",
        "--json-out", str(out),
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert code == 0 and report["identical"] is True
    assert set(report["methods"]) == {"plain", "ngram", "draft"}
    for row in report["methods"].values():
        assert row["c1"]["identical_to_plain"] and row["c2"]["output_tokens"] > 0
    assert report["methods"]["draft"]["spec"]["draft_tokens"] > 0
    assert set(report["verify_cost"]) == {"target", "draft"}
    assert report["verify_cost"]["target"]["verify_5rows_s"] > 0


def test_outputs_that_differ_are_reported() -> None:
    lv = {"outputs": {"0:None": {"text": "a"}}, "tok_s": 1.0, "output_tokens": 1}
    other = {"outputs": {"0:None": {"text": "b"}}, "tok_s": 2.0, "output_tokens": 1}
    args = type("A", (), {"workload": "edit"})()
    results = {
        "plain": {"levels": {1: lv}, "spec": {}},
        "ngram": {"levels": {1: other}, "spec": {}},
    }
    out = spec_decode.report(results, args)
    assert out["identical"] is False and out["methods"]["ngram"]["c1"]["vs_plain"] == 2.0


def test_llamacpp_methods_serve_the_same_files_with_their_spec_types(tmp_path: Path) -> None:
    args = spec_decode.parse_args([
        "--target", str(tmp_path), "--draft", str(tmp_path), "--llama-server", "llama-server",
        "--methods", "plain,llamacpp,llamacpp-draft,llamacpp-ngram", "--concurrency", "1,8",
    ])  # fmt: skip
    plain = spec_decode.llama_server("llamacpp", args).argv()
    assert "--spec-type" not in plain and plain[plain.index("-np") + 1] == "8"
    draft = spec_decode.llama_server("llamacpp-draft", args).argv()
    assert draft[draft.index("--spec-type") + 1] == "draft-simple"
    assert draft[draft.index("--model-draft") + 1] == str(tmp_path)
    ngram = spec_decode.llama_server("llamacpp-ngram", args).argv()
    assert ngram[ngram.index("--spec-type") + 1] == "ngram-simple" and "--model-draft" not in ngram


def test_llamacpp_rows_are_compared_by_speed_not_identity() -> None:
    lv = {"outputs": {"0:None": {"text": "a"}}, "tok_s": 4.0, "output_tokens": 1}
    theirs = {"outputs": {"0:None": {"text": "other"}}, "tok_s": 2.0, "output_tokens": 1}
    args = type("A", (), {"workload": "edit"})()
    results = {"plain": {"levels": {1: lv}, "spec": {}},
               "llamacpp": {"levels": {1: theirs}, "spec": {}}}  # fmt: skip
    out = spec_decode.report(results, args)
    assert out["identical"] is True and out["methods"]["llamacpp"]["c1"]["pdserve_over_it"] == 2.0
