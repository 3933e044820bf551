"""The worker's grammar compiler, built on first use from the engine's tokenizer."""

from __future__ import annotations

import asyncio
import threading

from pdserve.api.errors import ApiError, bad_request, unsupported
from pdserve.api.structured import Constraint
from pdserve.engine.protocol import TokenizerLike
from pdserve.grammar import GrammarCompiler, GrammarError, GrammarMatcher
from pdserve.grammar.compiler import GrammarLimits, validate_spec


class GrammarService:
    """Compiles a request's constraint into one matcher per choice (400s for bad grammars)."""

    def __init__(self, tokenizer: TokenizerLike, limits: GrammarLimits | None = None) -> None:
        self._tokenizer = tokenizer
        self._limits = limits or GrammarLimits()
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def _get_compiler(self, param: str) -> GrammarCompiler:
        # Blocking (the token trie of a 150k vocabulary takes ~1 s): called off the loop.
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
        """A fresh matcher per choice; the first compiles (off the loop, bounded), the rest copy.

        Raises a 400 naming ``constraint.param`` when the grammar does not compile.
        """
        compiler = self._compiler
        if compiler is None:
            loop = asyncio.get_running_loop()
            compiler = await loop.run_in_executor(None, self._get_compiler, constraint.param)
        try:
            first = await compiler.compile_async(constraint.spec)
        except GrammarError as exc:
            culprit, detail = constraint, str(exc)
            if constraint.parts:  # name the piece that fails alone, when one does
                found = await asyncio.get_running_loop().run_in_executor(
                    None, self._failing_part, constraint
                )
                culprit, detail = found or (culprit, detail)
            raise _invalid(culprit, detail) from None
        if num_choices == 1:
            return [first]
        # Cache hits (copies of the pristine matcher), still off the loop: an eviction in
        # between would make one a compile.
        spec = constraint.spec
        rest = await asyncio.get_running_loop().run_in_executor(
            None, lambda: [compiler.compile(spec) for _ in range(num_choices - 1)]
        )
        return [first, *rest]

    def _failing_part(self, constraint: Constraint) -> tuple[Constraint, str] | None:
        for part in constraint.parts:
            try:
                validate_spec(part.spec, self._limits)
            except GrammarError as exc:
                return part, str(exc)
        return None


def _invalid(constraint: Constraint, detail: str) -> ApiError:
    what = {"json_schema": "JSON schema", "regex": "regex", "choice": "choice list"}
    name = what.get(constraint.spec.kind, "grammar")
    label = f" ({constraint.label})" if constraint.label else ""
    return bad_request(f"Invalid {name} in '{constraint.param}'{label}: {detail}", constraint.param)
