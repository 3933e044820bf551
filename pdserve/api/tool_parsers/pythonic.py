"""Pythonic calls (Llama 3.2 / Llama 4 style): the answer is a Python list of calls,
``[get_weather(city="Oslo"), get_time()]``, keyword arguments as Python literals.

Only an answer that begins with ``[name(`` is parsed (text before a call is not a call here, as
in vLLM). Each call is sent whole, once its closing parenthesis arrives: its arguments are
Python literals, turned into JSON when complete. A call that does not parse, and all after it,
is content.
"""

from __future__ import annotations

import ast
import re

import orjson

from pdserve.api.tool_parsers.base import ToolParser
from pdserve.api.tools import ToolConfig

_START = re.compile(r"\s*\[\s*[A-Za-z_][A-Za-z0-9_.]*\s*\(")
_PARTIAL_START = re.compile(r"\s*(\[\s*([A-Za-z_][A-Za-z0-9_.]*\s*)?)?\Z")
_CALL_HEAD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.]*)\s*\(")
_PY_START, _PY_END = "<|python_start|>", "<|python_end|>"


class PythonicParser(ToolParser):
    name = "pythonic"

    def __init__(self, tools: ToolConfig) -> None:
        super().__init__(tools)
        self._state = "start"  # start | call | sep | end | plain
        self._scanned = 0  # call: characters of the buffer already scanned
        self._depth = 0
        self._quote = ""  # the open string's quote character(s)
        self._escaped = False
        self._opening = ""  # the "[" (and what led to it), given back if no call follows

    def _advance(self, final: bool) -> None:
        while self._buf and self._state != "plain":
            if not getattr(self, f"_st_{self._state}")(final):
                break
        if self._state == "plain" or final:
            if not self._num_opened:
                self._text(self._opening)
                self._opening = ""
            self._text(self._consume(len(self._buf)))

    def _st_start(self, final: bool) -> bool:
        text = self._buf.removeprefix(_PY_START) if self._buf.startswith(_PY_START) else self._buf
        match = _START.match(text)
        if match is None:
            waiting = _PARTIAL_START.match(text) or _PY_START.startswith(self._buf)
            if waiting and not final:
                return False
            self._state = "plain"
            return True
        self._opening = self._consume(len(self._buf) - len(text) + text.index("[") + 1)
        self._state = "call"
        self._scanned, self._depth = 0, 0
        return True

    def _st_sep(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        if stripped[0] == ",":
            self._consume(len(self._buf) - len(stripped) + 1)
            self._state, self._scanned, self._depth = "call", 0, 0
            return True
        if stripped[0] == "]":
            self._consume(len(self._buf) - len(stripped) + 1)
            self._state = "end"
            return True
        self._state = "plain"
        return True

    def _st_end(self, final: bool) -> bool:
        """After the list: Llama 4's closing tag is dropped, the rest is content."""
        rest = self._buf.lstrip()
        if rest.startswith(_PY_END):
            self._consume(len(self._buf) - len(rest) + len(_PY_END))
        elif not final and _PY_END.startswith(rest):
            return False
        self._state = "plain"
        return True

    def _st_call(self, final: bool) -> bool:
        end = self._scan_call()
        if end is None:
            return False
        source = self._buf[:end].strip()
        call = _parse_call(source)
        if call is None or not self._open_call(call[0]):
            self._state = "plain"
            return True
        self._consume(end)
        self._args(call[1])
        self._state = "sep"
        return True

    def _scan_call(self) -> int | None:
        """The end of the call at the buffer's start (its closing parenthesis), or None."""
        buf = self._buf
        i = self._scanned
        while i < len(buf):
            ch = buf[i]
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif len(buf) - i < len(self._quote) and self._quote.startswith(buf[i:]):
                    break  # maybe the closing triple quote: wait for the rest
                elif buf.startswith(self._quote, i):
                    i += len(self._quote) - 1
                    self._quote = ""
            elif ch in "\"'":
                triple = buf[i : i + 3]
                if i + 3 > len(buf) and triple == ch * len(triple):
                    break  # maybe a triple quote: wait for the rest
                self._quote = ch * 3 if triple == ch * 3 else ch
                i += len(self._quote) - 1
            elif ch in "([{":
                self._depth += 1
            elif ch in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    self._scanned = i + 1
                    return i + 1
            i += 1
        self._scanned = i
        return None


def _parse_call(source: str) -> tuple[str, str] | None:
    """(name, JSON arguments) of ``name(key=literal, ...)``, or None when it is not one."""
    if _CALL_HEAD.match(source) is None:
        return None
    try:
        node = ast.parse(source, mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            args[kw.arg] = ast.literal_eval(kw.value)
        return name, orjson.dumps(args).decode()
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
