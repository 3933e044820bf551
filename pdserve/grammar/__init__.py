"""Structured outputs: grammar specs from requests, compiled with llguidance, matched per token.

:class:`GrammarSpec` is what a request asks for (a JSON schema, a regex, a choice, a Lark
grammar); :class:`GrammarCompiler` turns it into a pristine matcher (cached, LRU); each
generation stream owns a :class:`GrammarMatcher` copy that advances by the token each step
sampled and then fills its next bitmask row in the background, during the next forward.
"""

from pdserve.grammar.compiler import GrammarCompiler, GrammarError
from pdserve.grammar.matcher import GrammarMatcher, prefetch_all
from pdserve.grammar.spec import GrammarSpec

__all__ = ["GrammarCompiler", "GrammarError", "GrammarMatcher", "GrammarSpec", "prefetch_all"]
