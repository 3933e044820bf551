"""--tool-call-parser: vLLM's names, ``auto`` read from the chat template, one CLI spelling."""

from __future__ import annotations

import pytest

from pdserve.api.tool_parsers import CHOICES, PARSERS, make_parser, resolve_parser
from pdserve.api.tool_parsers.forced import NamedParser, RequiredParser
from pdserve.cli_common import TOOL_PARSER_CHOICES
from pdserve.model.demo import CHAT_TEMPLATE

from .test_recorded_outputs import tool_config


def test_the_cli_offers_exactly_the_registered_parsers() -> None:
    assert TOOL_PARSER_CHOICES == CHOICES
    assert PARSERS["qwen3_xml"] is PARSERS["qwen3_coder"]


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        (CHAT_TEMPLATE, "hermes"),  # Qwen 2.5 / the demo model: <tool_call> JSON
        ("...<tool_call>\n<function=example>\n<parameter=x>...", "qwen3_coder"),
        ("{{ '[AVAILABLE_TOOLS]' }}...{{ '[TOOL_CALLS]' }}", "mistral"),
        ("Respond in the format [func_name1(params_name1=params_value1...)]", "pythonic"),
        ('<|python_tag|>... {"name": function name, "parameters": ...}', "llama3_json"),
        ("{{ messages }}", "hermes"),
        (None, "hermes"),
    ],
)
def test_auto_picks_the_format_the_chat_template_shows(template: str | None, parser: str) -> None:
    assert resolve_parser("auto", template) == parser


def test_a_named_parser_wins_over_the_template_and_an_unknown_one_is_refused() -> None:
    assert resolve_parser("pythonic", CHAT_TEMPLATE) == "pythonic"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        resolve_parser("granite", None)


def test_forced_choices_use_the_grammars_parsers_whatever_the_flag() -> None:
    from pdserve.api.config import ApiConfig
    from pdserve.api.tools import parse_tools

    named = parse_tools(
        {"tools": tool_config().tools, "tool_choice": {"type": "function",
                                                      "function": {"name": "get_time"}}},
        ApiConfig("m"),
    )  # fmt: skip
    body = {"tools": tool_config().tools, "tool_choice": "required"}
    required = parse_tools(body, ApiConfig("m"))
    assert named is not None and required is not None
    assert isinstance(make_parser(named, "mistral"), NamedParser)
    assert isinstance(make_parser(required, "hermes"), RequiredParser)


def test_only_parsers_whose_markers_are_special_tokens_keep_them_in_the_text() -> None:
    from pdserve.api.tool_parsers import needs_special_tokens

    assert needs_special_tokens("mistral")  # [TOOL_CALLS] is a control token
    assert not any(needs_special_tokens(p) for p in PARSERS if p != "mistral")
