"""bench/tool_calls.py: its 20 prompts and schemas, its scoring, and a smoke run on the demo
model (random weights: the counts mean nothing there, the streamed == unstreamed check does)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bench import tool_calls
from pdserve.model.demo import ensure_demo_model


def test_the_prompt_file_has_twenty_prompts_of_three_kinds_and_valid_schemas() -> None:
    tools, prompts = tool_calls.load_prompts()
    kinds = [p["kind"] for p in prompts]
    assert len(prompts) == 20
    assert (kinds.count("single"), kinds.count("parallel"), kinds.count("none")) == (8, 6, 6)
    for tool in tools:
        jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])


def test_only_calls_of_known_tools_with_schema_valid_arguments_score() -> None:
    tools, _ = tool_calls.load_prompts()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls = [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),  # valid
        ("get_weather", {"city": "Paris", "unit": "kelvin"}),  # not in the enum
        ("create_event", {"title": "x", "start": "2025-01-01T10:00"}),  # a required key missing
        ("launch_rockets", {}),  # no such tool
        ("get_local_time", "Tokyo"),  # arguments that are no object
    ]
    assert tool_calls.score_calls(calls, schemas) == 1


@pytest.mark.slow
def test_a_smoke_run_on_the_demo_model_reports_every_count(capsys: pytest.CaptureFixture) -> None:
    model = ensure_demo_model()
    argv = ["--target", "pdserve", "--model", str(model), "--limit", "3", "--max-tokens", "12",
            "--threads", "1", "--json"]  # fmt: skip
    assert tool_calls.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_prompts"] == 3 and len(result["rows"]) == 3
    assert result["num_stream_equal"] == 3  # greedy: streaming and not give one answer
    assert 0 <= result["num_valid_calls"] <= result["num_calls"]
    assert set(result["as_asked_by_kind"]) == {"single", "parallel", "none"}
