"""Qwen3-Coder XML calls (vLLM's ``qwen3_coder``, alias ``qwen3_xml``)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    </function>
    </tool_call>

Each parameter's text becomes a JSON value by its type in the tool's schema (a string stays a
string; numbers, booleans, objects and arrays are parsed, and kept as strings when they do not
parse). The arguments stream one parameter at a time: ``{"city": "Oslo"`` then ``}``.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import orjson

from pdserve.api.tool_parsers.base import ToolParser, longest_partial
from pdserve.api.tools import ToolConfig

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
_HEADER = re.compile(r"\s*<function=([^>\n]*)>")
_PARAM_HEAD = re.compile(r"\s*<parameter=([^>\n]*)>")


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, tools: ToolConfig) -> None:
        super().__init__(tools)
        self._state = "text"  # text | function | params | close
        self._in_tags = False  # the call came inside <tool_call> (the tag is optional)
        self._types: dict[str, Any] = {}
        self._num_params = 0

    def _advance(self, final: bool) -> None:
        while self._buf and getattr(self, f"_st_{self._state}")(final):
            pass
        if final and self._state == "params":  # cut short: close the object it began
            self._args("}")
            self._state = "text"
        if final and self._state == "function":
            self._text(OPEN if self._in_tags else "")
            self._text(self._consume(len(self._buf)))

    def _st_text(self, final: bool) -> bool:
        found = [(p, t) for t in (OPEN, FUNC) if (p := self._buf.find(t)) >= 0]
        if not found:
            keep = 0 if final else longest_partial(self._buf, (OPEN, FUNC))
            self._text(self._consume(len(self._buf) - keep))
            return False
        pos, tag = min(found)
        self._text(self._consume(pos))
        self._in_tags = tag == OPEN
        if self._in_tags:
            self._consume(len(OPEN))
        self._state = "function"
        return True

    def _st_function(self, final: bool) -> bool:
        match = _HEADER.match(self._buf)
        if match is None:
            stripped = self._buf.lstrip()
            if not final and (FUNC.startswith(stripped[: len(FUNC)]) and ">" not in stripped):
                return False
            return self._give_back()
        name = match.group(1).strip()
        if not self._open_call(name):
            return self._give_back()
        self._consume(match.end())
        self._types = _param_types(self._tools.parameters(name))
        self._num_params = 0
        self._args("{")
        self._state = "params"
        return True

    def _give_back(self) -> bool:
        if self._in_tags:
            self._text(OPEN)
        else:  # the bare <function= that started it: content, scanning resumes after it
            self._text(self._consume(len(FUNC)))
        self._state = "text"
        return True

    def _st_params(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if stripped.startswith(FUNC_END):
            self._consume(len(self._buf) - len(stripped) + len(FUNC_END))
            self._args("}")
            self._state = "close" if self._in_tags else "text"
            return True
        match = _PARAM_HEAD.match(self._buf)
        if match is None:
            head = stripped
            if not final and (
                not head
                or PARAM.startswith(head)
                or FUNC_END.startswith(head)
                or (head.startswith(PARAM) and ">" not in head)
            ):
                return False  # a tag may be starting
            nxt = self._buf.find("<", len(self._buf) - len(stripped) + 1)
            self._consume(len(self._buf) if nxt < 0 else nxt)  # stray text in a call: dropped
            return nxt >= 0
        start = match.end()
        ends = [p for t in (PARAM_END, PARAM, FUNC_END) if (p := self._buf.find(t, start)) >= 0]
        if not ends:
            return False
        end = min(ends)
        key = match.group(1).strip()
        value = self._buf[match.end() : end]
        self._consume(end + (len(PARAM_END) if self._buf.startswith(PARAM_END, end) else 0))
        sep = ", " if self._num_params else ""
        self._num_params += 1
        piece = orjson.dumps(_convert(value, self._types.get(key))).decode()
        self._args(f"{sep}{orjson.dumps(key).decode()}: {piece}")
        return True

    def _st_close(self, final: bool) -> bool:
        if not self._drop_through(CLOSE, final):
            return False
        self._state = "text"
        return True


def _param_types(schema: dict[str, Any]) -> dict[str, Any]:
    props = schema.get("properties")
    if not isinstance(props, dict):
        return {}
    return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}


def _convert(raw: str, kind: Any) -> Any:
    """A parameter's text as the JSON value its schema type asks for."""
    # One newline each side belongs to the markup, not the value.
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds:
        return text
    value = text.strip()
    if value.lower() in ("null", "none") and ("null" in kinds or kind is None):
        return None
    # Python literals (True, single quotes) only where the schema says what to expect.
    readers = [orjson.loads] if kind is None else [orjson.loads, ast.literal_eval]
    for read in readers:
        try:
            parsed = read(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if (kind is None or _fits(parsed, kinds)) and _is_json(parsed):
            return parsed
    if "boolean" in kinds and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return text


def _is_json(value: Any) -> bool:
    try:
        orjson.dumps(value)
    except TypeError:
        return False
    return True


def _fits(value: Any, kinds: list[Any]) -> bool:
    checks = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "null": lambda v: v is None,
    }
    return any(k in checks and checks[k](value) for k in kinds)
