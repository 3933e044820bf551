"""Mistral calls after the ``[TOOL_CALLS]`` marker, in either of its two spellings:

- v0.3 tokenizers: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (a JSON array);
- v11+ tokenizers: ``[TOOL_CALLS]name[ARGS]{...}``, the marker repeated before each call.

Text before the marker is content. ``[TOOL_CALLS]`` is a special token: while this parser is in
use the detokenizer keeps special tokens (as vLLM sets ``skip_special_tokens: false``).
"""

from __future__ import annotations

import re

from pdserve.api.tool_parsers.base import ToolParser, longest_partial
from pdserve.api.tool_parsers.json_call import CallObjectReader, JsonScanner, Status, skip_ws
from pdserve.api.tools import ToolConfig

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class MistralParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def __init__(self, tools: ToolConfig) -> None:
        super().__init__(tools)
        self._state = "text"  # text | marker | args | array_sep | array | plain
        self._reader: CallObjectReader | None = None
        self._scanner = JsonScanner()

    def _advance(self, final: bool) -> None:
        while True:
            if self._state == "plain" or (self._state == "text" and not self._buf):
                if self._buf:
                    self._text(self._consume(len(self._buf)))
                return
            if not getattr(self, f"_st_{self._state}")(final):
                return

    def _st_text(self, final: bool) -> bool:
        pos = self._buf.find(MARKER)
        if pos < 0:
            keep = 0 if final else longest_partial(self._buf, (MARKER,))
            self._text(self._consume(len(self._buf) - keep))
            return False
        self._text(self._consume(pos))
        self._consume(len(MARKER))
        self._state = "marker"
        return True

    def _st_marker(self, final: bool) -> bool:
        buf = self._buf
        i = skip_ws(buf, 0)
        if i == len(buf):
            return self._give_back() if final else False
        if buf[i] == "[":
            self._consume(i + 1)
            self._state = "array_sep"
            return True
        match = _NAME.match(buf, i)
        end = match.end() if match else i
        rest = buf[end:]
        if not final and ARGS.startswith(rest):
            return False  # the name, or the [ARGS] after it, may go on
        after = end + len(ARGS) if rest.startswith(ARGS) else end
        if match is None or buf[after : after + 1] != "{":
            if after == len(buf) and not final:
                return False
            return self._give_back()
        if not self._open_call(match.group()):
            return self._give_back()
        self._consume(after)
        self._scanner = JsonScanner()
        self._state = "args"
        return True

    def _give_back(self) -> bool:
        """The marker led to no call: it and what follows are content."""
        self._text(MARKER)
        self._state = "plain"
        return True

    def _st_args(self, final: bool) -> bool:
        end = self._scanner.scan(self._buf, final)
        self._args(self._consume(len(self._buf) if end is None else end))
        if end is None and not final:
            return False
        self._state = "text"
        return True

    def _st_array_sep(self, final: bool) -> bool:
        i = skip_ws(self._buf, 0)
        if i < len(self._buf) and self._buf[i] == ",":
            i = skip_ws(self._buf, i + 1)
        if i == len(self._buf):
            return False
        self._consume(i)
        if self._buf[0] == "]":
            self._consume(1)
            self._state = "text"
            return True
        self._reader = CallObjectReader(self)
        self._state = "array"
        return True

    def _st_array(self, final: bool) -> bool:
        assert self._reader is not None
        status = self._reader.step(final)
        if status is Status.MORE:
            return False
        self._reader = None
        self._state = "plain" if status is Status.REJECTED else "array_sep"
        return True
