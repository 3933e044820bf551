"""Hermes / Qwen 2.5 calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Text outside the calls is content; any number of calls; the arguments stream as written.
Small models often drop the tags (Qwen2.5-Coder-0.5B writes a call in a ```json fence, or
bare): like llama.cpp's Hermes parser, a call object ``{"name": <a tool>, "arguments": ...}``
also counts fenced or bare, anywhere in the text. A ``{`` that does not begin such an object
is content as soon as its first key shows it.
"""

from __future__ import annotations

from pdserve.api.tool_parsers.base import ToolParser, longest_partial
from pdserve.api.tool_parsers.json_call import CallObjectReader, Status, skip_ws
from pdserve.api.tools import ToolConfig

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCES = ("```json\n", "```\n")
FENCE_END = "```"
ARGS_KEYS = ("arguments", "parameters")


class HermesParser(ToolParser):
    name = "hermes"

    def __init__(self, tools: ToolConfig) -> None:
        super().__init__(tools)
        self._reader: CallObjectReader | None = None  # inside a call
        self._opener = ""  # what began it: OPEN, a fence, or "" (a bare object)
        self._state = "text"  # text | call | close | fence_end

    def _advance(self, final: bool) -> None:
        while True:
            if self._state == "call":
                assert self._reader is not None
                status = self._reader.step(final)
                if status is Status.MORE:
                    return
                self._reader = None
                if status is Status.REJECTED:  # no call: the opener is content
                    self._text(self._opener or self._consume(1))
                    self._state = "text"
                else:
                    self._state = {OPEN: "close", "": "text"}.get(self._opener, "fence_end")
            elif self._state == "close":
                if not self._skip_to_close(final):
                    return
            elif self._state == "fence_end":
                if not self._skip_fence_end(final):
                    return
            elif not self._buf or not self._scan_text(final):
                return

    def _scan_text(self, final: bool) -> bool:
        """Content up to the next place a call may begin; True when one was entered."""
        found = [(p, m) for m in (OPEN, *FENCES, "{") if (p := self._buf.find(m)) >= 0]
        if not found:
            keep = 0 if final else longest_partial(self._buf, (OPEN, *FENCES))
            self._text(self._consume(len(self._buf) - keep))
            return False
        pos, marker = min(found)
        self._text(self._consume(pos))
        self._opener = "" if marker == "{" else self._consume(len(marker))
        self._reader = CallObjectReader(self, ARGS_KEYS, is_whole_allowed=marker == OPEN)
        self._state = "call"
        return True

    def _skip_to_close(self, final: bool) -> bool:
        """Drop what is left inside the tags; True once past the closing tag."""
        if not self._drop_through(CLOSE, final):
            return False
        self._state = "text"
        return True

    def _skip_fence_end(self, final: bool) -> bool:
        """Drop the fence that closes a fenced call; True once decided."""
        i = skip_ws(self._buf, 0)
        rest = self._buf[i:]
        if rest.startswith(FENCE_END):
            self._consume(i + len(FENCE_END))
        elif not final and FENCE_END.startswith(rest):
            return False
        self._state = "text"
        return True
