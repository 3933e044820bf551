"""Structured outputs: grammar specs from requests, compiled with llguidance, matched per token.

:class:`GrammarSpec` is what a request asks for (a JSON schema, a regex, a choice, a Lark
grammar); :class:`GrammarCompiler` turns it into a pristine matcher (cached, LRU); each
generation stream owns a :class:`GrammarMatcher` copy that fills its row of the token bitmask
before a step and advances by the token the step sampled.
"""

from pdserve.grammar.compiler import GrammarCompiler, GrammarError
from pdserve.grammar.matcher import GrammarMatcher
from pdserve.grammar.spec import GrammarSpec

__all__ = ["GrammarCompiler", "GrammarError", "GrammarMatcher", "GrammarSpec"]
