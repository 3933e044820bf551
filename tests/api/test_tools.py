"""Tools: validation of tools / tool_choice and the enforcing schemas (parsing the output:
tests/api/tool_parsers)."""

from __future__ import annotations

import json

import pytest

from pdserve.api.config import ApiConfig
from pdserve.api.errors import ApiError
from pdserve.api.tools import ToolConfig, parse_tools

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
    assert named.param == "tools[0].function.parameters" and "weather" in named.label
    required = _config("required", parallel_tool_calls=False).constraint()
    schema = json.loads(required.spec.source)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [b["properties"]["name"]["const"] for b in schema["items"]["anyOf"]]
    assert names == ["weather", "time"]
    # Each tool's schema alone too: a compile error names the one that fails.
    assert [p.param for p in required.parts] == [
        "tools[0].function.parameters",
        "tools[1].function.parameters",
    ]
