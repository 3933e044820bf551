"""Hermes / Qwen 2.5 calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Text outside the tags is content; any number of calls; the arguments stream as written.
"""

from __future__ import annotations

from pdserve.api.tool_parsers.base import ToolParser, longest_partial
from pdserve.api.tool_parsers.json_call import CallObjectReader, Status
from pdserve.api.tools import ToolConfig

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def __init__(self, tools: ToolConfig) -> None:
        super().__init__(tools)
        self._reader: CallObjectReader | None = None  # inside a call's tags
        self._to_close = False  # the call object ended: skip to the closing tag

    def _advance(self, final: bool) -> None:
        while True:
            if self._reader is not None:
                status = self._reader.step(final)
                if status is Status.MORE:
                    return
                if status is Status.REJECTED:  # the tag was no call: it is content
                    self._text(OPEN)
                self._reader = None
                self._to_close = status is Status.DONE
            elif self._to_close:
                if not self._skip_to_close(final):
                    return
            elif not self._buf or not self._scan_text(final):
                return

    def _scan_text(self, final: bool) -> bool:
        """Content up to the next opening tag; True when one was entered."""
        pos = self._buf.find(OPEN)
        if pos < 0:
            keep = 0 if final else longest_partial(self._buf, (OPEN,))
            self._text(self._consume(len(self._buf) - keep))
            return False
        self._text(self._consume(pos))
        self._consume(len(OPEN))
        self._reader = CallObjectReader(self)
        return True

    def _skip_to_close(self, final: bool) -> bool:
        """Drop what is left inside the tags; True once past the closing tag."""
        pos = self._buf.find(CLOSE)
        if pos < 0:
            keep = 0 if final else longest_partial(self._buf, (CLOSE,))
            self._consume(len(self._buf) - keep)
            return False
        self._consume(pos + len(CLOSE))
        self._to_close = False
        return True
