"""The thinking block at the token level: where a grammar starts, and the thinking budget.

A request served with a reasoning parser carries a :class:`ReasoningSpec` (the tag token ids,
whether the output starts inside the block, the budget). Its sequence gets a
:class:`ThinkingState`, which the engine tells about every committed token
(:func:`grammar_sees`):

- while thinking, the request's structured-output or tool grammar sleeps: it is not the
  sequence's ``grammar`` (so no bitmask applies and no fill runs) and is fed nothing;
- the end-of-thinking token wakes it: from the next token on it constrains the rest, starting
  from its first state (the closing tag itself is never fed to it);
- once ``max_tokens`` thinking tokens were generated, the sampler allows only the
  end-of-thinking token at the next step (:attr:`ThinkingState.must_end`).

Everything depends on the sequence's own tokens only, so a request's tokens do not depend on
its batch, its chunking or its worker (a PD decode leg replays the first token here too).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdserve.grammar.matcher import GrammarMatcher

# Tokens between the end of a prompt and its last tag that may be skipped as whitespace
# (Qwen3's disabled block ends the prompt with "</think>\n\n": one or two tokens).
_MAX_TRAILING_SPACE_TOKENS = 4


class Sequence(Protocol):
    """What the gate sees of a :class:`pdserve.sequence.Sequence` (which holds the state)."""

    grammar: GrammarMatcher | None
    reasoning: ThinkingState | None


@dataclass(frozen=True, slots=True)
class ReasoningSpec:
    """A request's thinking block as the engine enforces it."""

    start_id: int  # <think>
    end_id: int  # </think>
    is_thinking: bool  # the output starts inside the block
    max_tokens: int | None = None  # the thinking budget (None: unlimited)


def starts_thinking(
    prompt_ids: Seq[int],
    start_id: int,
    end_id: int,
    token_text: Callable[[int], str],
    default: bool = True,
) -> bool:
    """Does generation start inside a thinking block? Read from the prompt's last tokens: an
    opening tag there (R1, Qwen3-2507 thinking templates) says yes, a closing one (Qwen3 with
    ``enable_thinking: false``) no; otherwise ``default`` (True for both parsers: the model
    opens the block itself, or thinks without the tag)."""
    for token in reversed(prompt_ids[-(_MAX_TRAILING_SPACE_TOKENS + 1) :]):
        if token == start_id:
            return True
        if token == end_id:
            return False
        if token_text(token).strip():
            break
    return default


class ThinkingState:
    """One sequence's place relative to its thinking block (the engine loop is its writer)."""

    __slots__ = ("spec", "is_thinking", "num_thinking_tokens", "_sleeping_grammar")

    def __init__(self, spec: ReasoningSpec) -> None:
        self.spec = spec
        self.is_thinking = spec.is_thinking
        self.num_thinking_tokens = 0
        self._sleeping_grammar: GrammarMatcher | None = None

    @classmethod
    def attach(cls, seq: Sequence, spec: ReasoningSpec) -> ThinkingState:
        """Give ``seq`` its state; a grammar it already holds sleeps while it thinks."""
        state = cls(spec)
        seq.reasoning = state
        if state.is_thinking and seq.grammar is not None:
            state._sleeping_grammar, seq.grammar = seq.grammar, None
        return state

    @property
    def must_end(self) -> bool:
        """The budget is spent: the next token has to be the end-of-thinking token."""
        budget = self.spec.max_tokens
        return self.is_thinking and budget is not None and self.num_thinking_tokens >= budget

    def observe(self, seq: Sequence, token: int) -> bool:
        """``token`` was appended to ``seq``: whether its grammar (if any) is to be fed it."""
        if not self.is_thinking:
            return True
        if token == self.spec.end_id:
            self.is_thinking = False
            seq.grammar, self._sleeping_grammar = self._sleeping_grammar, None
            return False
        if token != self.spec.start_id:  # an opening tag is no thinking text
            self.num_thinking_tokens += 1
        return False


def grammar_sees(seq: Sequence, token: int) -> bool:
    """Tell ``seq``'s thinking state (if any) of its new ``token``; whether the sequence's
    grammar is to be advanced by it."""
    state = seq.reasoning
    return state is None or state.observe(seq, token)
