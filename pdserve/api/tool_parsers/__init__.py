"""Tool-call parsers, one module per output format, chosen by ``--tool-call-parser``.

The names are vLLM's: ``hermes``, ``llama3_json``, ``mistral``, ``qwen3_coder`` (alias
``qwen3_xml``), ``pythonic``; ``auto`` (the default) picks one from the chat template's own
call syntax. ``tool_choice`` ``required`` and a named function use the parsers of
:mod:`~pdserve.api.tool_parsers.forced` whatever the flag says (the grammar shaped the text).
The seam with the chat stream is :class:`~pdserve.api.tool_parsers.base.ToolParser`.
"""

from __future__ import annotations

import re

from pdserve.api.tool_parsers.base import (
    ParseDelta,
    ToolCallDelta,
    ToolParser,
    accumulate,
    parse_whole,
)
from pdserve.api.tool_parsers.forced import NamedParser, RequiredParser
from pdserve.api.tool_parsers.hermes import HermesParser
from pdserve.api.tool_parsers.llama3_json import Llama3JsonParser
from pdserve.api.tool_parsers.mistral import MistralParser
from pdserve.api.tool_parsers.pythonic import PythonicParser
from pdserve.api.tool_parsers.qwen3_coder import Qwen3CoderParser
from pdserve.api.tools import ToolConfig

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "qwen3_coder": Qwen3CoderParser,
    "qwen3_xml": Qwen3CoderParser,
    "pythonic": PythonicParser,
}
CHOICES = ("auto", *PARSERS)
DEFAULT_PARSER = "hermes"  # a template that shows no call syntax of its own
_PYTHONIC_HINT = re.compile(r"\[func_name\d?\(")


def resolve_parser(flag: str, chat_template: str | None) -> str:
    """The parser ``--tool-call-parser FLAG`` means for a model with ``chat_template``."""
    if flag != "auto":
        if flag not in PARSERS:
            raise ValueError(f"unknown tool-call parser {flag!r}; one of {', '.join(CHOICES)}")
        return flag
    template = chat_template or ""
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if _PYTHONIC_HINT.search(template):
        return "pythonic"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3_json"
    return DEFAULT_PARSER


def make_parser(tools: ToolConfig, parser: str) -> ToolParser:
    """A fresh parser for one choice of a request with ``tools`` (mode not ``none``)."""
    if tools.mode == "named":
        return NamedParser(tools)
    if tools.mode == "required":
        return RequiredParser(tools)
    return PARSERS[parser](tools)


def needs_special_tokens(parser: str) -> bool:
    """Whether the parser's markers are special tokens the detokenizer must keep."""
    return bool(getattr(PARSERS[parser], "needs_special_tokens", False))


__all__ = [
    "CHOICES",
    "DEFAULT_PARSER",
    "PARSERS",
    "ParseDelta",
    "ToolCallDelta",
    "ToolParser",
    "accumulate",
    "make_parser",
    "needs_special_tokens",
    "parse_whole",
    "resolve_parser",
]
