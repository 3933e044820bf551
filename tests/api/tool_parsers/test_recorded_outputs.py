"""Every parser on model outputs written in its family's exact format (tests/data/tool_calls:
single call, two parallel calls, no call, text before a call, arguments whose strings hold
braces, quotes and tags), fed whole and in every split: the streamed deltas accumulate to the
unstreamed parse, and no piece of call markup ever reaches the content."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.api.config import ApiConfig
from pdserve.api.tool_parsers import ParseDelta, accumulate, make_parser, parse_whole
from pdserve.api.tools import ToolConfig, parse_tools

CASES: list[dict[str, Any]] = json.loads(
    (Path(__file__).parents[2] / "data" / "tool_calls" / "recorded_outputs.json").read_text()
)
MARKUP = ("<tool_call", "</tool_call", "<function=", "<parameter=", "[TOOL_CALLS", "[ARGS]",
          "<|python_tag|>", "<|python_start|>", "<|python_end|>")  # fmt: skip


def _fn(name: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": props, "required": required}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = [
    _fn("get_weather", {"city": {"type": "string"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _fn("get_time", {"tz": {"type": "string"}}, ["tz"]),
    _fn("search_code", {"query": {"type": "string"}, "filters": {"type": "object"}}, ["query"]),
    _fn("run_sql", {"query": {"type": "string"}}, ["query"]),
]  # fmt: skip


def tool_config(parallel: bool = True) -> ToolConfig:
    config = parse_tools({"tools": TOOLS, "parallel_tool_calls": parallel}, ApiConfig("m"))
    assert config is not None
    return config


def _ids(case: dict[str, Any]) -> str:
    return f"{case['parser']}-{case['name']}"


def _stream(case: dict[str, Any], cuts: list[int], tools: ToolConfig) -> list[ParseDelta]:
    parser = make_parser(tools, case["parser"])
    text, bounds = case["text"], [0, *sorted(cuts), len(case["text"])]
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return [*deltas, parser.finish()]


def _shape(parsed: tuple[str | None, list[Any]]) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parsed
    return content, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_recorded_output_parses_to_its_content_and_calls(case: dict[str, Any]) -> None:
    content, calls = parse_whole(make_parser(tool_config(), case["parser"]), case["text"])
    assert content == case["content"]
    assert [c.name for c in calls] == [name for name, _ in case["calls"]]
    for call, (_, args) in zip(calls, case["calls"], strict=True):
        if args is not None:  # a call cut short keeps the arguments it had
            assert json.loads(call.arguments) == args
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_every_split_streams_to_the_unstreamed_parse(case: dict[str, Any]) -> None:
    tools = tool_config()
    whole = _shape(parse_whole(make_parser(tools, case["parser"]), case["text"]))
    n = len(case["text"])
    for cuts in [[i] for i in range(n + 1)] + [list(range(1, n))]:  # one cut; every char
        deltas = _stream(case, cuts, tools)
        assert _shape(accumulate(deltas)) == whole, cuts
        if case["calls"]:
            for d in deltas:
                assert not any(m[:2] in d.content and m in case["text"] for m in MARKUP), d


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(0, 400), max_size=12))
def test_any_chunking_streams_to_the_unstreamed_parse(
    case: dict[str, Any], cuts: list[int]
) -> None:
    tools = tool_config()
    cuts = [c for c in cuts if c <= len(case["text"])]
    whole = _shape(parse_whole(make_parser(tools, case["parser"]), case["text"]))
    assert _shape(accumulate(_stream(case, cuts, tools))) == whole


@pytest.mark.parametrize("case", [c for c in CASES if len(c["calls"]) == 2], ids=_ids)
def test_parallel_tool_calls_false_keeps_only_the_first_call(case: dict[str, Any]) -> None:
    tools = tool_config(parallel=False)
    content, calls = parse_whole(make_parser(tools, case["parser"]), case["text"])
    assert content == case["content"] and [c.name for c in calls] == [case["calls"][0][0]]
    for i in range(len(case["text"]) + 1):
        deltas = _stream(case, [i], tools)
        assert {c.index for d in deltas for c in d.calls} == {0}
        assert _shape(accumulate(deltas)) == _shape((content, calls))


@pytest.mark.parametrize("case", [c for c in CASES if c["calls"]], ids=_ids)
def test_a_calls_first_piece_has_its_id_and_name_and_later_ones_only_arguments(
    case: dict[str, Any],
) -> None:
    pieces = [c for d in _stream(case, list(range(1, len(case["text"]))), tool_config())
              for c in d.calls]  # fmt: skip
    seen: set[int] = set()
    for piece in pieces:
        shape = piece.to_dict()
        if piece.index not in seen:
            assert shape["id"].startswith("call_") and shape["type"] == "function"
            assert shape["function"]["name"] and "arguments" in shape["function"]
            seen.add(piece.index)
        else:
            assert shape == {"index": piece.index, "function": {"arguments": piece.arguments}}
    assert sorted(seen) == list(range(len(case["calls"])))
