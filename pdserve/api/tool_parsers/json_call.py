"""Incremental reading of one JSON call object, ``{"name": ..., "arguments": {...}}``.

Shared by the formats that write calls as JSON objects (Hermes inside ``<tool_call>``, Llama 3
JSON, Mistral's array, ``tool_choice: required``'s array). The arguments are streamed as the
model writes them (raw JSON text), once the name before them is known; objects whose keys come
in another order are read whole and sent as one piece.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import orjson

from pdserve.api.tool_parsers.base import ToolParser

_WS = " \t\r\n"


class JsonScanner:
    """Finds where a JSON value ends, fed piece by piece (strings and nesting tracked)."""

    __slots__ = ("_depth", "_in_string", "_escaped", "_started")

    def __init__(self, depth: int = 0) -> None:
        self._depth = depth  # > 0: already inside that many containers
        self._in_string = False
        self._escaped = False
        self._started = depth > 0

    def scan(self, text: str, final: bool = False) -> int | None:
        """The end (exclusive) of the value in ``text`` continuing what was scanned, or None
        when it goes on past ``text``. A bare scalar ends at a delimiter (or at ``final``)."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 0:
                        return i + 1
                continue
            if not self._started:
                if ch in _WS:
                    continue
                self._started = True
                if ch == '"':
                    self._in_string = True
                    continue
                if ch not in "{[":
                    self._depth = -1  # a scalar: runs until a delimiter
                    continue
            if self._depth < 0:
                if ch in _WS or ch in ",}]":
                    return i
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return len(text) if final and self._depth < 0 else None


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


class _More(Exception):
    """The text ends before the header is decided."""


class _NotHeader(Exception):
    """The text is not ``{"name": ..., <args key>:`` (maybe another key order)."""


class Header(NamedTuple):
    name: str
    end: int  # where the arguments value starts (or the object's closing brace)
    has_args: bool


def _string(text: str, i: int) -> tuple[str, int]:
    if i >= len(text):
        raise _More
    if text[i] != '"':
        raise _NotHeader
    j, escaped = i + 1, False
    while j < len(text):
        ch = text[j]
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == '"':
            return orjson.loads(text[i : j + 1]), j + 1
        j += 1
    raise _More


def _expect(text: str, i: int, ch: str) -> int:
    i = skip_ws(text, i)
    if i >= len(text):
        raise _More
    if text[i] != ch:
        raise _NotHeader
    return skip_ws(text, i + 1)


def read_header(text: str, args_keys: tuple[str, ...]) -> Header | None:
    """The call header at the start of ``text`` (which starts at ``{``); None: undecided yet.

    Raises :class:`_NotHeader` when the object does not start with the name."""
    try:
        i = _expect(text, 0, "{")
        key, i = _string(text, i)
        if key != "name":
            raise _NotHeader
        i = _expect(text, i, ":")
        name, i = _string(text, i)
        i = skip_ws(text, i)
        if i >= len(text):
            return None
        if text[i] == "}":
            return Header(name, i, False)
        i = _expect(text, i, ",")
        key, i = _string(text, i)
        if key not in args_keys:
            raise _NotHeader
        return Header(name, _expect(text, i, ":"), True)
    except _More:
        return None


class Status(enum.Enum):
    MORE = "more"  # everything decidable was consumed; feed more
    DONE = "done"  # the object ended: what follows is the caller's
    REJECTED = "rejected"  # not a call: nothing was consumed or emitted


class _State(enum.Enum):
    HEADER = "header"
    ARGS = "args"
    TAIL = "tail"
    WHOLE = "whole"


class CallObjectReader:
    """Reads one call object from the parser's buffer, emitting through the parser."""

    def __init__(
        self,
        parser: ToolParser,
        args_keys: tuple[str, ...] = ("arguments",),
        is_whole_allowed: bool = True,
    ) -> None:
        self._parser = parser
        self._args_keys = args_keys
        # False: only ``{"name": ...`` counts (a bare "{" in prose is rejected at its first key).
        self._is_whole_allowed = is_whole_allowed
        self._state = _State.HEADER
        self._scanner = JsonScanner()
        self._scanned = 0  # WHOLE: characters of the buffer already scanned
        self._args_kind = ""  # ARGS: the value's first character decides how it is sent
        self._held = ""  # ARGS of a string or scalar: held until it ends

    def step(self, final: bool) -> Status:
        """Advance over the parser's buffer (the object starts at its first character)."""
        p = self._parser
        if self._state is _State.HEADER:
            try:
                header = read_header(p._buf, self._args_keys)
            except _NotHeader:
                if not self._is_whole_allowed:
                    return Status.REJECTED
                self._state = _State.WHOLE
                return self._whole(final)
            if header is None:
                return Status.REJECTED if final else Status.MORE
            if not p._open_call(header.name):
                return Status.REJECTED
            p._consume(header.end)
            if not header.has_args:
                p._args("{}")
                self._state, self._scanner = _State.TAIL, JsonScanner(depth=1)
            else:
                self._state = _State.ARGS
        if self._state is _State.WHOLE:
            return self._whole(final)
        if self._state is _State.ARGS and not self._stream_args(final):
            return Status.DONE if final else Status.MORE
        end = self._scanner.scan(p._buf)
        if end is None:
            p._consume(len(p._buf))
            return Status.DONE if final else Status.MORE
        p._consume(end)
        return Status.DONE

    def _stream_args(self, final: bool) -> bool:
        """Send the arguments seen so far; True once they ended (the tail is next)."""
        p = self._parser
        if not self._args_kind:
            i = skip_ws(p._buf, 0)
            p._consume(i)
            if not p._buf:
                return False
            self._args_kind = "raw" if p._buf[0] in "{[" else "held"
        end = self._scanner.scan(p._buf, final)
        piece = p._consume(len(p._buf) if end is None else end)
        if self._args_kind == "raw":
            p._args(piece)
        else:
            self._held += piece
        if end is None and not final:
            return False
        if self._args_kind == "held":
            p._args(_held_arguments(self._held))
        self._state, self._scanner = _State.TAIL, JsonScanner(depth=1)
        return True

    def _whole(self, final: bool) -> Status:
        p = self._parser
        end = self._scanner.scan(p._buf[self._scanned :])
        if end is None:
            self._scanned = len(p._buf)
            return Status.REJECTED if final else Status.MORE
        end += self._scanned
        try:
            value = orjson.loads(p._buf[:end])
        except orjson.JSONDecodeError:
            return Status.REJECTED
        name = value.get("name") if isinstance(value, dict) else None
        args = _args_of(value, self._args_keys) if isinstance(name, str) else None
        if args is None or not p._open_call(name):
            return Status.REJECTED
        p._consume(end)
        p._args(args)
        return Status.DONE


def _args_of(value: dict, keys: tuple[str, ...]) -> str | None:
    for key in keys:
        if key in value:
            args = value[key]
            if isinstance(args, str):
                return args
            return "{}" if args is None else orjson.dumps(args).decode()
    return "{}"


def _held_arguments(text: str) -> str:
    """Arguments sent as a JSON string (some models encode them) or a scalar."""
    text = text.strip()
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text
    if value is None:
        return "{}"
    return value if isinstance(value, str) else text
