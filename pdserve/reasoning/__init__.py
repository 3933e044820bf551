"""Reasoning (thinking) blocks: ``<think> ... </think>`` before a model's answer.

Two halves, one per layer that needs them:

- :mod:`pdserve.reasoning.parser`: text. A :class:`ReasoningSplitter` per choice splits the
  generated text, streamed in any chunking, into the thinking text and the answer, never
  showing part of a tag in either (the HTTP layer's ``reasoning_content`` / ``content``).
- :mod:`pdserve.reasoning.gate`: tokens. A :class:`ThinkingState` per sequence keeps a
  structured-output grammar asleep until the end-of-thinking token and forces that token once
  a thinking budget is spent (the engine and the sampler).
"""

from pdserve.reasoning.gate import ReasoningSpec, ThinkingState, grammar_sees
from pdserve.reasoning.parser import PARSERS, ReasoningFormat, ReasoningSplitter

__all__ = [
    "PARSERS",
    "ReasoningFormat",
    "ReasoningSpec",
    "ReasoningSplitter",
    "ThinkingState",
    "grammar_sees",
]
