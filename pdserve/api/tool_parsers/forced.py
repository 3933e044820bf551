"""The output of a forced choice, which the grammar shaped (no markup to find):

- a named function (``tool_choice: {"type": "function", ...}``): the text is its arguments;
- ``tool_choice: required``: a JSON array of ``{"name", "parameters"}`` objects.
"""

from __future__ import annotations

from pdserve.api.tool_parsers.base import ToolParser
from pdserve.api.tool_parsers.json_call import CallObjectReader, Status, skip_ws
from pdserve.api.tools import ToolConfig


class NamedParser(ToolParser):
    """One call of the named function; the text streams as its arguments."""

    name = "named"

    def __init__(self, tools: ToolConfig) -> None:
        super().__init__(tools)
        assert tools.named is not None
        self._is_open = False
        self._has_args = False
        self._held = ""  # trailing whitespace: sent only if more arguments follow

    def _advance(self, final: bool) -> None:
        if not self._is_open:
            assert self._tools.named is not None
            self._open_call(self._tools.named)
            self._is_open = True
        text = self._held + self._consume(len(self._buf))
        if not self._has_args:
            text = text.lstrip()
        body = text.rstrip()
        self._held = "" if final else text[len(body) :]
        if body:
            self._args(body)
            self._has_args = True


class RequiredParser(ToolParser):
    """``[{"name": ..., "parameters": {...}}, ...]``: each call streams as it is written."""

    name = "required"

    def __init__(self, tools: ToolConfig) -> None:
        super().__init__(tools)
        self._state = "open"  # open | sep | call | done
        self._reader: CallObjectReader | None = None

    def _advance(self, final: bool) -> None:
        while self._buf and self._state != "done":
            if self._state == "call":
                assert self._reader is not None
                status = self._reader.step(final)
                if status is Status.MORE:
                    return
                self._state = "sep" if status is Status.DONE else "done"
                continue
            i = skip_ws(self._buf, 0)
            if i == len(self._buf):
                return
            ch = self._buf[i]
            self._consume(i + 1)
            if (self._state == "open" and ch == "[") or (self._state == "sep" and ch == ","):
                self._reader = CallObjectReader(self, ("parameters", "arguments"))
                self._state = "call"
            else:  # "]" or anything the grammar would not allow: the calls are over
                self._state = "done"
        if self._state == "done":
            self._consume(len(self._buf))
