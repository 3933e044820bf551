"""Grammar compilation with llguidance: specs -> pristine matchers, LRU-cached, off the loop.

llguidance builds its lexer and parser when a matcher is constructed (the Rust side drops the
GIL while it does); we keep one pristine matcher per spec and hand each generation stream a
``deep_copy`` of it, so a repeated schema costs a copy, not a compile. The tokenizer side
(``LLTokenizer``, a token trie over the vocabulary) is built once from ``tokenizer.json``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from pdserve.grammar.filler import MaskFiller, shared_filler
from pdserve.grammar.matcher import GrammarMatcher
from pdserve.grammar.spec import GrammarSpec

logger = logging.getLogger(__name__)

# Compact JSON: no optional whitespace, so a constrained stream cannot idle in blank space
# (a weak model otherwise fills max_tokens with newlines and never closes the object).
_JSON_OPTIONS: llguidance.JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The spec is invalid, too large, or took too long to compile (a client error)."""


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on what one request may cost the grammar engine (llguidance parser limits)."""

    compile_timeout_s: float = 10.0
    cache_size: int = 128
    max_grammar_size: int = 200_000  # symbols in the compiled productions
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            max_grammar_size=self.max_grammar_size,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            verbose_errors=False,  # errors go back to clients: no parser dumps
        )


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for ``spec``."""
    if spec.kind in ("json_schema", "json_object"):
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                spec.schema_text(), overrides=_JSON_OPTIONS
            )
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from exc
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(spec.choice_lark())
    try:  # Lark as is; GBNF (vLLM's and llama.cpp's EBNF, `root ::= ...`) converted to it
        lark = any_to_lark(spec.source)
    except Exception as exc:  # the converter's own parse errors, of any type
        raise GrammarError(f"invalid grammar: {exc}") from exc
    return llguidance.LLMatcher.grammar_from_lark(lark)


def validate_spec(spec: GrammarSpec, limits: GrammarLimits | None = None) -> None:
    """Raise :class:`GrammarError` when ``spec`` does not compile (no tokenizer needed)."""
    limits = limits or GrammarLimits()
    message = llguidance.LLMatcher.validate_grammar(
        grammar_text(spec), limits=limits.parser_limits()
    )
    if message and not message.startswith("WARNING"):
        raise GrammarError(message.strip())


class GrammarCompiler:
    """Compiles specs for one tokenizer; thread-safe; one per worker process.

    ``background_fill``: its matchers fill their masks on the process's filler thread
    (:func:`~pdserve.grammar.filler.shared_filler`) once prefetched; False: on the runner's
    thread when the step asks (the serial path).
    """

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        limits: GrammarLimits | None = None,
        background_fill: bool = True,
    ) -> None:
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self._filler: MaskFiller | None = shared_filler() if background_fill else None
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher for ``spec`` (blocking: run it off the event loop)."""
        with self._lock:
            pristine = self._cache.get(spec)
            if pristine is not None:
                self._cache.move_to_end(spec)
        if pristine is None:
            pristine = self._build(spec)
            with self._lock:
                self._cache[spec] = pristine
                while len(self._cache) > self.limits.cache_size:
                    self._cache.popitem(last=False)
        return GrammarMatcher(pristine.deep_copy(), self.vocab_size, self._filler)

    def _build(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        text = grammar_text(spec)
        matcher = llguidance.LLMatcher(
            self._tokenizer, text, log_level=0, limits=self.limits.parser_limits()
        )
        if matcher.is_error():
            raise GrammarError(matcher.get_error().strip())
        return matcher

    async def compile_async(self, spec: GrammarSpec) -> GrammarMatcher:
        """:meth:`compile` on a worker thread, bounded by ``limits.compile_timeout_s``.

        A compile that times out keeps its thread until the parser's own fuel limits stop it;
        the request is refused at once either way.
        """
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, self.compile, spec)
        try:
            return await asyncio.wait_for(future, self.limits.compile_timeout_s)
        except TimeoutError:
            logger.info("grammar compile (%s) timed out", spec.kind)
            raise GrammarError(
                f"the grammar took longer than {self.limits.compile_timeout_s:g} s to compile"
            ) from None
