"""Tools: validation of tools / tool_choice, the enforcing schemas, and output parsing."""

from __future__ import annotations

import json

import orjson
import pytest

from pdserve.api.config import ApiConfig
from pdserve.api.errors import ApiError
from pdserve.api.tools import ToolConfig, may_start_call, parse_tool_calls, parse_tools

CONFIG = ApiConfig(served_model_name="m")
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "time"}},
]


def _config(choice: object = "auto", **body: object) -> ToolConfig:
    config = parse_tools({"tools": TOOLS, "tool_choice": choice, **body}, CONFIG)
    assert config is not None
    return config


def test_tool_choices_parse_into_modes() -> None:
    assert parse_tools({}, CONFIG) is None
    assert parse_tools({"tools": [], "tool_choice": "none"}, CONFIG) is None
    assert _config().mode == "auto" and _config(None).mode == "auto"
    assert _config("none").template_tools is None
    assert _config("required").mode == "required"
    named = _config({"type": "function", "function": {"name": "time"}})
    assert named.mode == "named" and named.named == "time"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice.function.name"),
        ({"tools": [{"type": "code"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
         "tools[0].function.x"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_tools(body, CONFIG)
    assert info.value.status == 400 and info.value.param == param


def test_required_and_named_choices_are_enforced_by_a_schema() -> None:
    assert _config().constraint() is None
    named = _config({"type": "function", "function": {"name": "weather"}}).constraint()
    assert named is not None and json.loads(named.spec.source) == PARAMS
    required = _config("required", parallel_tool_calls=False).constraint()
    schema = json.loads(required.spec.source)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [b["properties"]["name"]["const"] for b in schema["items"]["anyOf"]]
    assert names == ["weather", "time"]


def test_hermes_calls_are_parsed_with_the_content_before_them() -> None:
    text = (
        'Let me check.<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>{"name": "time", "arguments": {}}</tool_call>'
    )
    content, calls = parse_tool_calls(text, _config())
    assert content == "Let me check."
    assert [(c.name, orjson.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo"}),
        ("time", {}),
    ]
    assert len({c.id for c in calls}) == 2


def test_llama3_json_calls_are_parsed() -> None:
    text = '<|python_tag|>{"name": "weather", "parameters": {"city": "Rome"}}'
    content, calls = parse_tool_calls(text, _config())
    assert content is None and calls[0].name == "weather"
    assert orjson.loads(calls[0].arguments) == {"city": "Rome"}
    _, two = parse_tool_calls(
        '{"name": "time", "parameters": {}}; {"name": "weather", "parameters": {"city": "x"}}',
        _config(),
    )
    assert [c.name for c in two] == ["time", "weather"]


def test_text_that_is_no_call_stays_content() -> None:
    for text in ("plain words", '{"name": "unknown", "parameters": {}}', "<tool_call>{broken"):
        assert parse_tool_calls(text, _config()) == (text, [])


def test_required_output_is_a_json_array_of_calls() -> None:
    text = '[{"name": "weather", "parameters": {"city": "Lima"}}]'
    content, calls = parse_tool_calls(text, _config("required"))
    assert content is None and calls[0].name == "weather"
    named = _config({"type": "function", "function": {"name": "weather"}})
    assert parse_tool_calls('{"city":"Lima"}', named)[1][0].arguments == '{"city":"Lima"}'


def test_streaming_holds_text_only_from_where_a_call_may_start() -> None:
    auto = _config()
    assert may_start_call("Hello there", auto) == len("Hello there")
    assert may_start_call("Hello <tool", auto) == len("Hello ")
    assert may_start_call("Hi <tool_call>{", auto) == 3
    assert may_start_call('  {"name"', auto) == 0
    assert may_start_call("<|python", auto) == 0
    assert may_start_call("x", _config("required")) == 0
