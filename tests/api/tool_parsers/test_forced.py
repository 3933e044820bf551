"""tool_choice named and required: the grammar-shaped text streams as calls, in every split."""

from __future__ import annotations

import json

import pytest

from pdserve.api.config import ApiConfig
from pdserve.api.tool_parsers import accumulate, make_parser, parse_whole
from pdserve.api.tools import ToolConfig, parse_tools

from .test_recorded_outputs import TOOLS


def _config(choice: object, parallel: bool = True) -> ToolConfig:
    body = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel}
    config = parse_tools(body, ApiConfig("m"))
    assert config is not None
    return config


NAMED = {"type": "function", "function": {"name": "search_code"}}
REQUIRED_TEXT = (
    '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
    '{"name": "search_code", "parameters": {"query": "x = {\\"}\\": 1}"}}]'
)


def _every_split(config: ToolConfig, text: str) -> list[tuple[str | None, list]]:
    out = []
    for i in range(len(text) + 1):
        parser = make_parser(config, "hermes")
        content, calls = accumulate([parser.feed(text[:i]), parser.feed(text[i:]), parser.finish()])
        out.append((content, [(c.name, c.arguments) for c in calls]))
    return out


def test_a_named_function_streams_the_text_as_its_arguments() -> None:
    text = ' {"query": "a } b", "filters": {"lang": ["py"]}}\n'
    content, calls = parse_whole(make_parser(_config(NAMED), "hermes"), text)
    assert content is None and [c.name for c in calls] == ["search_code"]
    assert calls[0].arguments == text.strip()
    assert set(map(str, _every_split(_config(NAMED), text))) == {
        str((None, [("search_code", text.strip())]))
    }


@pytest.mark.parametrize("parallel", [True, False])
def test_required_streams_each_call_of_the_array(parallel: bool) -> None:
    config = _config("required", parallel)
    content, calls = parse_whole(make_parser(config, "hermes"), REQUIRED_TEXT)
    names = ["get_weather", "search_code"] if parallel else ["get_weather"]
    assert content is None and [c.name for c in calls] == names
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    splits = _every_split(config, REQUIRED_TEXT)
    assert all(s == (content, [(c.name, c.arguments) for c in calls]) for s in splits)
