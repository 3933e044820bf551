"""Splitting generated text into its thinking block and its answer, streamed or whole.

Both parsers pdserve knows (vLLM's names) read one format: an optional ``<think>``, the
thinking text, ``</think>``, then the answer.

- ``deepseek_r1``: R1 templates open the block in the prompt, so the output usually starts
  inside it with no opening tag (R1-0528 writes the tag itself; it is dropped).
- ``qwen3``: Qwen3 writes ``<think>`` itself (Qwen3-2507 thinking templates put it in the prompt
  instead); with ``enable_thinking: false`` the template closes an empty block in the prompt and
  everything generated is the answer.

Where the output starts (inside a block or in the answer) is decided per request from the
prompt (:func:`pdserve.reasoning.gate.starts_thinking`), the same rule the engine's token gate
uses, so the text split and the grammar's start agree. An output that ends before ``</think>``
is all thinking (the answer is empty), as vLLM reads a truncated block.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """What a ``--reasoning-parser`` name stands for: the block's tags (each one token)."""

    name: str
    start: str = THINK_OPEN
    end: str = THINK_CLOSE


PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1"),
    "qwen3": ReasoningFormat("qwen3"),
}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag`` (0: none)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


class ReasoningSplitter:
    """One choice's text -> (thinking, answer), fed in deltas of any size.

    Text that may still become a tag is held back (a trailing ``</thi``, a leading ``<th``)
    until it is a tag or cannot be one, so neither part ever shows half a tag; whitespace between
    ``</think>`` and the answer is dropped (Qwen3 and R1 write ``</think>\\n\\n``). Feeding a
    text in one piece or in any chunks gives the same two strings.
    """

    def __init__(self, fmt: ReasoningFormat, is_thinking: bool) -> None:
        self._fmt = fmt
        self._is_thinking = is_thinking
        self._at_block_start = is_thinking  # a leading opening tag is still possible
        self._at_answer_start = False  # right after the closing tag: whitespace is dropped
        self._held = ""

    @property
    def is_thinking(self) -> bool:
        return self._is_thinking

    def feed(self, text: str) -> tuple[str, str]:
        """The thinking and answer text that ``text`` completes (either may be empty)."""
        buf, self._held = self._held + text, ""
        thought = ""
        if self._is_thinking:
            thought, buf = self._think(buf)
        if self._is_thinking:
            return thought, ""
        if self._at_answer_start:
            stripped = buf.lstrip()
            if not stripped:
                return thought, ""
            self._at_answer_start, buf = False, stripped
        return thought, buf

    def finish(self) -> tuple[str, str]:
        """What is still held at the end of the output: text that never became a tag."""
        held, self._held = self._held, ""  # only thinking text is ever held
        return (held, "") if self._is_thinking else ("", "")

    def split(self, text: str) -> tuple[str, str]:
        """A whole output: (thinking, answer)."""
        thought, answer = self.feed(text)
        more_thought, more_answer = self.finish()
        return thought + more_thought, answer + more_answer

    def _think(self, buf: str) -> tuple[str, str]:
        """Consume thinking text: (thinking shown, text after the closing tag)."""
        start, end = self._fmt.start, self._fmt.end
        if self._at_block_start:
            lead = buf.lstrip()
            if start.startswith(lead):  # nothing but whitespace or part of the tag yet
                if lead == start:
                    self._at_block_start = False
                    return "", ""
                self._held = buf
                return "", ""
            self._at_block_start = False
            if lead.startswith(start):
                buf = lead[len(start) :]
        pos = buf.find(end)
        if pos >= 0:
            self._is_thinking = False
            self._at_answer_start = True
            return buf[:pos], buf[pos + len(end) :]
        keep = _partial_suffix(buf, end)
        if keep:
            self._held = buf[-keep:]
            buf = buf[:-keep]
        return buf, ""
