"""Llama 3.1 / 3.2 JSON calls: ``{"name": ..., "parameters": {...}}`` at the start of the answer,
optionally after ``<|python_tag|>``, several separated by ``;``.

Only an answer that begins with a call is parsed (vLLM's rule): a ``{`` later in the text is
prose. A leading object that is no call (unknown name, other keys) is content, and so is all
that follows it; text after the calls is content too.
"""

from __future__ import annotations

from pdserve.api.tool_parsers.base import ToolParser
from pdserve.api.tool_parsers.json_call import CallObjectReader, Status, skip_ws
from pdserve.api.tools import ToolConfig

PYTHON_TAG = "<|python_tag|>"
ARGS_KEYS = ("parameters", "arguments")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def __init__(self, tools: ToolConfig) -> None:
        super().__init__(tools)
        self._is_plain = False  # decided: the rest is content
        self._reader: CallObjectReader | None = None
        self._tag = ""  # the <|python_tag|> consumed, given back if no call follows

    def _advance(self, final: bool) -> None:
        while not self._is_plain:
            if self._reader is not None:
                status = self._reader.step(final)
                if status is Status.MORE:
                    return
                self._reader = None
                if status is Status.REJECTED:
                    self._plain()
                continue
            i = skip_ws(self._buf, 0)
            rest = self._buf[i:]
            if not rest:
                if final:
                    self._plain()
                return
            if self.num_calls_made and rest[0] == ";":
                self._consume(i + 1)
                continue
            if not self.num_calls_made and not self._tag and rest.startswith(PYTHON_TAG):
                self._consume(i)
                self._tag = self._consume(len(PYTHON_TAG))
                continue
            if not final and PYTHON_TAG.startswith(rest) and not self.num_calls_made:
                return  # maybe the tag
            if rest[0] != "{":
                self._plain()
                continue
            self._text(self._consume(i))  # whitespace: held, dropped if a call opens
            self._reader = CallObjectReader(self, ARGS_KEYS)
        if self._buf:
            self._text(self._consume(len(self._buf)))

    @property
    def num_calls_made(self) -> int:
        return self._num_opened

    def _plain(self) -> None:
        self._is_plain = True
        if self._tag and not self._num_opened:
            self._text(self._tag)
        self._tag = ""
