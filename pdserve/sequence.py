"""A Sequence is one generation stream's state as the model runner sees it.

Plain object, no behaviour beyond derived counts: the scheduler owns it and mutates it on the
event loop; the runner only reads it (and the scheduler applies the runner's results).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.grammar.matcher import GrammarMatcher
    from pdserve.reasoning.gate import ThinkingState


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    page_ids: list[int] = field(default_factory=list)  # KV pages, in token order
    num_cached_tokens: int = 0  # tokens whose K/V are already written into page_ids
    # Structured output: the runner masks each step by it, the engine advances it per token.
    grammar: GrammarMatcher | None = None
    # A reasoning request: where its thinking block stands (its grammar sleeps until it ends).
    reasoning: ThinkingState | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
