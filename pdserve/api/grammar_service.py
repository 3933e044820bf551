"""The worker's grammar compiler, built on first use from the engine's tokenizer."""

from __future__ import annotations

import threading

from pdserve.api.errors import ApiError, bad_request, unsupported
from pdserve.api.structured import Constraint
from pdserve.engine.protocol import TokenizerLike
from pdserve.grammar import GrammarCompiler, GrammarError, GrammarMatcher
from pdserve.grammar.compiler import GrammarLimits


class GrammarService:
    """Compiles a request's constraint into one matcher per choice (400s for bad grammars)."""

    def __init__(self, tokenizer: TokenizerLike, limits: GrammarLimits | None = None) -> None:
        self._tokenizer = tokenizer
        self._limits = limits or GrammarLimits()
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def _get_compiler(self, param: str) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                # pdserve's Tokenizer wraps a `tokenizers` one: llguidance reads its JSON.
                backend = getattr(self._tokenizer, "backend", None)
                if backend is None or not hasattr(backend, "to_str"):
                    raise unsupported(param, "structured outputs need a tokenizer.json tokenizer")
                self._compiler = GrammarCompiler(
                    backend.to_str(),
                    self._tokenizer.vocab_size,
                    self._tokenizer.eos_token_ids,
                    self._limits,
                )
            return self._compiler

    async def matchers(self, constraint: Constraint, num_choices: int) -> list[GrammarMatcher]:
        """A fresh matcher per choice; the first compiles (off the loop, bounded), the rest copy."""
        compiler = self._get_compiler(constraint.param)
        try:
            first = await compiler.compile_async(constraint.spec)
        except GrammarError as exc:
            raise _invalid(constraint, str(exc)) from None
        matchers = [first]
        for _ in range(num_choices - 1):
            matchers.append(compiler.compile(constraint.spec))  # a cache hit: a copy
        return matchers


def _invalid(constraint: Constraint, detail: str) -> ApiError:
    what = {"json_schema": "JSON schema", "regex": "regex", "choice": "choice list"}
    name = what.get(constraint.spec.kind, "grammar")
    return bad_request(f"Invalid {name} in '{constraint.param}': {detail}", constraint.param)
