"""``--reasoning-parser`` in the HTTP layer: the request fields, each choice's thinking block
for the engine, and the split of its text into ``reasoning_content`` and ``content``.

The split runs first on a choice's generated text; only the answer after ``</think>`` goes on
to content and tool-call parsing (:class:`ChoiceReasoning`, used by the chat response builder).

Request fields (chat completions):

- ``thinking_token_budget`` (vLLM's name; -1: unlimited), ``thinking_budget`` (SGLang's),
  ``max_reasoning_tokens``: one of them, an integer >= 0: at most that many thinking tokens,
  then ``</think>`` is forced (:mod:`pdserve.reasoning.gate`). Needs a reasoning parser.
- ``include_reasoning`` (vLLM): false leaves ``reasoning_content`` out (still split off).
- ``chat_template_kwargs.enable_thinking`` goes to the template like every template kwarg; a
  false one also makes a prompt that does not say otherwise start in the answer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.api.errors import bad_request, unsupported
from pdserve.api.validation import as_bool, as_int, optional
from pdserve.engine.protocol import GenerateOutput, GenerateRequest, TokenizerLike
from pdserve.reasoning.gate import ReasoningSpec, starts_thinking
from pdserve.reasoning.parser import PARSERS, ReasoningFormat, ReasoningSplitter

logger = logging.getLogger(__name__)

BUDGET_FIELDS = ("thinking_token_budget", "thinking_budget", "max_reasoning_tokens")
REASONING_FIELDS = frozenset({*BUDGET_FIELDS, "include_reasoning"})
MAX_BUDGET = 2**31 - 1
Chunk = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ReasoningOptions:
    """A chat request's reasoning fields."""

    max_tokens: int | None = None  # the thinking budget
    include: bool = True  # include_reasoning


@dataclass(frozen=True, slots=True)
class ReasoningTokens:
    """The server's reasoning parser and its tags' token ids in this tokenizer."""

    fmt: ReasoningFormat
    start_id: int
    end_id: int


def parse_reasoning_options(body: dict[str, Any], parser_name: str | None) -> ReasoningOptions:
    """The budget and ``include_reasoning`` of a chat body; 400 naming the field."""
    given = [name for name in BUDGET_FIELDS if body.get(name) is not None]
    if len(given) > 1:
        raise bad_request(
            f"Only one thinking budget per request; got '{given[0]}' and '{given[1]}'.",
            param=given[1],
        )
    budget = None
    if given:
        name = given[0]
        value = as_int(body[name], name, -1, MAX_BUDGET)  # -1: unlimited, as in vLLM
        if value != -1:
            if parser_name is None:
                raise unsupported(name, "the server runs without --reasoning-parser")
            budget = value
    include = as_bool(optional(body, "include_reasoning", True), "include_reasoning")
    return ReasoningOptions(budget, include)


def resolve_reasoning(parser_name: str | None, tokenizer: TokenizerLike) -> ReasoningTokens | None:
    """The parser named by ``--reasoning-parser`` with its tag ids; a ValueError (at start-up)
    when the name is unknown or a tag is not one token of the vocabulary."""
    if parser_name is None:
        return None
    fmt = PARSERS.get(parser_name)
    if fmt is None:
        raise ValueError(
            f"unknown reasoning parser {parser_name!r}; known: {', '.join(sorted(PARSERS))}"
        )
    ids = []
    for tag in (fmt.start, fmt.end):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"--reasoning-parser {parser_name}: {tag!r} is not one token of this model's "
                f"vocabulary (it encodes to {len(encoded)}): not a {parser_name} tokenizer"
            )
        ids.append(encoded[0])
        if tokenizer.decode(encoded, skip_special_tokens=True) != tag:
            # The split reads the text: a special tag is left out of it by default.
            logger.warning(
                "--reasoning-parser %s: %r is a special token of this tokenizer; requests must "
                "send skip_special_tokens: false for it to be split off", parser_name, tag,
            )  # fmt: skip
    return ReasoningTokens(fmt, ids[0], ids[1])


def attach_reasoning(
    requests: list[GenerateRequest],
    tokens: ReasoningTokens | None,
    options: ReasoningOptions,
    template_kwargs: dict[str, Any],
    tokenizer: TokenizerLike,
) -> ChoiceReasoning | None:
    """Give each choice's engine request its thinking block; the response split (None: the
    server has no reasoning parser)."""
    if tokens is None:
        return None
    default = template_kwargs.get("enable_thinking") is not False

    def text(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=False)

    phases = []
    for req in requests:
        is_thinking = starts_thinking(
            req.prompt_token_ids, tokens.start_id, tokens.end_id, text, default
        )
        req.reasoning = ReasoningSpec(
            tokens.start_id, tokens.end_id, is_thinking, options.max_tokens
        )
        phases.append(is_thinking)
    return ChoiceReasoning(tokens.fmt, phases, options.include)


class ChoiceReasoning:
    """The response side: each choice's text split before content / tool parsing."""

    def __init__(self, fmt: ReasoningFormat, phases: list[bool], include: bool) -> None:
        self._fmt = fmt
        self._phases = phases  # does choice i start inside its thinking block
        self._splitters = [ReasoningSplitter(fmt, p) for p in phases]
        self.include = include

    def split_delta(self, index: int, out: GenerateOutput) -> tuple[str, GenerateOutput]:
        """A streamed delta -> (its thinking text, the delta carrying only its answer text)."""
        splitter = self._splitters[index]
        thought, answer = splitter.feed(out.text)
        if out.finish_reason is not None:
            more_thought, more_answer = splitter.finish()
            thought, answer = thought + more_thought, answer + more_answer
        if answer != out.text:
            out = dataclasses.replace(out, text=answer)
        return thought, out

    def split_text(self, index: int, text: str) -> tuple[str, str]:
        """A whole output -> (thinking, answer)."""
        return ReasoningSplitter(self._fmt, self._phases[index]).split(text)

    def chunk(
        self,
        index: int,
        out: GenerateOutput,
        content_chunk: Callable[[int, GenerateOutput], Chunk | None],
        new_chunk: Callable[[Chunk], Chunk],
    ) -> Chunk | None:
        """The stream chunk of a delta: ``content_chunk`` of its answer part (or a
        ``new_chunk`` of an empty delta when that has nothing to send), its thinking first."""
        thought, out = self.split_delta(index, out)
        chunk = content_chunk(index, out)
        if not thought or not self.include:
            return chunk
        if chunk is None:
            chunk = new_chunk(
                {"index": index, "delta": {}, "logprobs": None, "finish_reason": None}
            )
        choice = chunk["choices"][0]
        choice["delta"] = {"reasoning_content": thought, **choice["delta"]}
        return chunk

    def message(
        self,
        index: int,
        text: str,
        content_message: Callable[[int, str], tuple[Chunk, str | None]],
    ) -> tuple[Chunk, str | None]:
        """A non-streamed choice's (message, finish reason): ``content_message`` of its
        answer, with its thinking text (None: the output had none)."""
        thought, answer = self.split_text(index, text)
        message, finish = content_message(index, answer)
        if self.include:
            message["reasoning_content"] = thought or None
        return message, finish
