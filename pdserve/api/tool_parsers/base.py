"""The seam between a chat stream and a tool-call parser, and what every parser shares.

A parser is a streaming state machine over the model's text: :meth:`ToolParser.feed` takes the
next text delta and returns a :class:`ParseDelta` (content to show, tool-call deltas in the
OpenAI shape); :meth:`ToolParser.finish` flushes what is left at the end. It holds back only
text that may still turn out to be (part of) call markup, so no partial tag is ever shown as
content. The non-streaming parse (:func:`parse_whole`) runs the same machine over the whole
text, so a streamed answer accumulates to exactly the non-streamed message.

Every parser is split-invariant: its decisions depend on the text seen, never on where the
deltas were cut (tests feed recorded outputs at every character boundary).

Shared rules, per vLLM where it has one:
- A call opens only for a function in ``tools``; markup around an unknown name stays content.
- Whitespace-only text next to calls is dropped (held until non-space text follows).
- ``parallel_tool_calls: false``: calls after the first are parsed and dropped (vLLM's
  ``maybe_filter_parallel_tool_calls``), content is kept.
- A call cut short (``max_tokens``) keeps the arguments it streamed, as OpenAI sends them.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pdserve.api.tools import ToolCall, ToolConfig


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCallDelta:
    """One call's piece of a delta; ``name`` (and ``id``) only on the call's first piece."""

    index: int
    arguments: str = ""
    name: str | None = None
    id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ParseDelta:
    """What one text delta turned into: content to show and tool-call pieces."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def extend(self, other: ParseDelta) -> ParseDelta:
        """Both deltas as one (a call's pieces joined)."""
        calls = list(self.calls)
        for piece in other.calls:
            last = calls[-1] if calls else None
            if last is not None and piece.name is None and last.index == piece.index:
                args = last.arguments + piece.arguments
                calls[-1] = ToolCallDelta(last.index, args, last.name, last.id)
            else:
                calls.append(piece)
        return ParseDelta(self.content + other.content, calls)


class ToolParser(ABC):
    """One choice's parser. Subclasses implement :meth:`_advance` over ``self._buf``."""

    name: ClassVar[str]

    def __init__(self, tools: ToolConfig) -> None:
        self._names = frozenset(t["function"]["name"] for t in tools.tools)
        self._tools = tools
        self._buf = ""  # text received and not yet decided
        self._held_ws = ""  # trailing whitespace of the content, held until text follows
        self._content: list[str] = []
        self._calls: list[ToolCallDelta] = []
        self._num_opened = 0  # calls the model made (dropped ones too)
        self._num_sent = 0  # calls this parser reported
        self._is_dropping = False  # the current call is dropped (parallel_tool_calls: false)

    def feed(self, text: str) -> ParseDelta:
        """The next text delta of the model; returns what can be shown of it now."""
        self._buf += text
        self._advance(final=False)
        return self._take()

    def finish(self) -> ParseDelta:
        """The text has ended: decide everything still held."""
        self._advance(final=True)
        if self._num_opened == 0 and self._held_ws:
            self._content.append(self._held_ws)  # a plain answer keeps its trailing space
        self._held_ws = ""
        return self._take()

    @property
    def num_calls(self) -> int:
        """Calls reported so far."""
        return self._num_sent

    @abstractmethod
    def _advance(self, final: bool) -> None:
        """Consume what can be decided of ``self._buf`` (all of it when ``final``)."""

    # What subclasses emit through.

    def _consume(self, n: int) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        return taken

    def _drop_through(self, marker: str, final: bool) -> bool:
        """Drop the buffer up to and including ``marker``; True once past it (a possible start
        of it at the end is kept until more text decides)."""
        pos = self._buf.find(marker)
        if pos < 0:
            keep = 0 if final else longest_partial(self._buf, (marker,))
            self._consume(len(self._buf) - keep)
            return False
        self._consume(pos + len(marker))
        return True

    def _text(self, text: str) -> None:
        """Content; its trailing whitespace waits to see whether a call follows."""
        text = self._held_ws + text
        kept = text.rstrip()
        if kept:
            self._content.append(kept)
        self._held_ws = text[len(kept) :]

    def _open_call(self, name: str) -> bool:
        """A call of ``name`` begins; False (nothing emitted) when no tool has that name."""
        if name not in self._names:
            return False
        self._held_ws = ""
        self._num_opened += 1
        self._is_dropping = not self._tools.parallel and self._num_opened > 1
        if not self._is_dropping:
            self._calls.append(ToolCallDelta(self._num_sent, "", name, new_call_id()))
            self._num_sent += 1
        return True

    def _args(self, text: str) -> None:
        """More of the open call's arguments (raw JSON text as the model wrote it)."""
        if not text or self._is_dropping:
            return
        last = self._calls[-1] if self._calls else None
        if last is not None and last.index == self._num_sent - 1:
            last.arguments += text
        else:
            self._calls.append(ToolCallDelta(self._num_sent - 1, text))

    def _take(self) -> ParseDelta:
        delta = ParseDelta("".join(self._content), self._calls)
        self._content, self._calls = [], []
        return delta


def longest_partial(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper start of one of ``markers``."""
    best = 0
    for marker in markers:
        for keep in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-keep:]):
                best = keep
                break
    return best


def parse_whole(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output: the streaming machine run over all of it."""
    deltas = [parser.feed(text), parser.finish()]
    return accumulate(deltas)


def accumulate(deltas: list[ParseDelta]) -> tuple[str | None, list[ToolCall]]:
    """What a client assembles from streamed deltas: content (None when empty beside calls)."""
    content = "".join(d.content for d in deltas)
    names: dict[int, tuple[str, str]] = {}
    args: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.calls:
            if c.name is not None:
                assert c.id is not None
                names[c.index] = (c.name, c.id)
            args.setdefault(c.index, []).append(c.arguments)
    calls = [ToolCall(names[i][0], "".join(args[i]), names[i][1]) for i in sorted(names)]
    return (content or None) if calls else content, calls
