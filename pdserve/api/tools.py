"""Tool calling: ``tools`` / ``tool_choice`` validation and the grammar of a forced choice.

- ``auto``: the tools go to the chat template; calls are parsed from the text by the parser
  ``--tool-call-parser`` names (:mod:`pdserve.api.tool_parsers`).
- ``required``: the output is constrained to a JSON array of ``{"name", "parameters"}``
  objects, one schema branch per tool; ``{"type": "function", ...}`` (named): the output is
  constrained to that function's parameters schema and is its arguments.
- ``none``: the tools are not shown to the model.

A schema the grammar engine cannot compile is a 400 naming the function and its
``tools[i].function.parameters``.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from pdserve.api.config import ApiConfig
from pdserve.api.errors import bad_request, unrecognized_argument
from pdserve.api.structured import Constraint
from pdserve.api.validation import as_bool, as_list, as_object, as_str, optional, require
from pdserve.grammar.spec import GrammarSpec

ToolMode = Literal["none", "auto", "required", "named"]
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True, slots=True)
class ToolConfig:
    """A chat request's tools (as the chat template receives them) and how they are chosen."""

    tools: list[dict[str, Any]]
    mode: ToolMode
    named: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls: False allows one call (required: maxItems 1)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if self.mode == "none" or not self.tools else self.tools

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    def _schema_constraint(self, i: int) -> Constraint:
        """Tool ``i``'s parameters as a grammar, its compile errors naming the function."""
        name = self.tools[i]["function"]["name"]
        spec = GrammarSpec.json_schema(self.parameters(name))
        return Constraint(spec, f"tools[{i}].function.parameters", f"function '{name}'")

    def constraint(self) -> Constraint | None:
        """The grammar that enforces a ``required`` or named choice."""
        if self.mode == "named":
            names = [t["function"]["name"] for t in self.tools]
            return self._schema_constraint(names.index(self.named))
        if self.mode != "required":
            return None
        branches = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "parameters": t["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
        if not self.parallel:
            schema["maxItems"] = 1
        parts = tuple(self._schema_constraint(i) for i in range(len(self.tools)))
        return Constraint(GrammarSpec.json_schema(schema), "tool_choice", parts=parts)


def parse_tools(body: dict[str, Any], config: ApiConfig) -> ToolConfig | None:
    """Validate ``tools`` and ``tool_choice``; None when the request uses no tools."""
    raw_tools = body.get("tools")
    choice = body.get("tool_choice")
    tools = [] if raw_tools is None else _parse_tool_list(raw_tools, config)
    parallel = as_bool(optional(body, "parallel_tool_calls", True), "parallel_tool_calls")
    if not tools:
        if choice is None or choice == "none":
            return None
        raise bad_request("'tool_choice' is only allowed when 'tools' are given.", "tool_choice")
    if choice is None or choice in ("auto", "none", "required"):
        return ToolConfig(tools, choice or "auto", parallel=parallel)
    if isinstance(choice, str):
        raise bad_request(
            f"Invalid value for 'tool_choice': '{choice}'. Supported values are: 'none', "
            "'auto', 'required', or an object naming a function.",
            param="tool_choice",
        )
    obj = as_object(choice, "tool_choice")
    kind = as_str(require(obj, "type", "tool_choice.type"), "tool_choice.type")
    if kind != "function":
        raise bad_request("'tool_choice.type' must be 'function'.", param="tool_choice.type")
    fn = as_object(require(obj, "function", "tool_choice.function"), "tool_choice.function")
    name = as_str(require(fn, "name", "tool_choice.function.name"), "tool_choice.function.name")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(
            f"'tool_choice' names function '{name}', which is not in 'tools'.",
            param="tool_choice.function.name",
        )
    return ToolConfig(tools, "named", name, parallel)


def _parse_tool_list(value: Any, config: ApiConfig) -> list[dict[str, Any]]:
    items = as_list(value, "tools")
    if len(items) > config.max_tools:
        raise bad_request(
            f"Too many tools: {len(items)}, the maximum is {config.max_tools}.", param="tools"
        )
    tools, names = [], set()
    for i, raw in enumerate(items):
        param = f"tools[{i}]"
        tool = as_object(raw, param)
        for key in tool:
            if key not in ("type", "function"):
                raise unrecognized_argument(f"{param}.{key}")
        if as_str(require(tool, "type", f"{param}.type"), f"{param}.type") != "function":
            raise bad_request(f"'{param}.type' must be 'function'.", param=f"{param}.type")
        fn = as_object(require(tool, "function", f"{param}.function"), f"{param}.function")
        for key in fn:
            if key not in ("name", "description", "parameters", "strict"):
                raise unrecognized_argument(f"{param}.function.{key}")
        name = as_str(require(fn, "name", f"{param}.function.name"), f"{param}.function.name")
        if not NAME_PATTERN.fullmatch(name):
            raise bad_request(
                f"'{param}.function.name' must be 1..64 characters of [A-Za-z0-9_.-].",
                param=f"{param}.function.name",
            )
        if name in names:
            raise bad_request(f"Duplicate tool name '{name}'.", param=f"{param}.function.name")
        names.add(name)
        if fn.get("description") is not None:
            as_str(fn["description"], f"{param}.function.description")
        as_bool(optional(fn, "strict", False), f"{param}.function.strict")
        if fn.get("parameters") is not None:
            as_object(fn["parameters"], f"{param}.function.parameters")
        tools.append({"type": "function", "function": fn})
    size = len(orjson.dumps(tools))
    if size > config.max_grammar_chars:
        raise bad_request(
            f"'tools' is too large: {size} characters, the maximum is {config.max_grammar_chars}.",
            param="tools",
        )
    return tools
