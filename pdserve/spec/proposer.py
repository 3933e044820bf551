"""Proposers: what drafts the tokens a verify step checks (runner thread)."""

from __future__ import annotations

from typing import Protocol

from pdserve.sequence import Sequence
from pdserve.spec.config import SpeculativeConfig
from pdserve.spec.ngram import propose_ngram


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ``ks[i]`` drafts after ``seqs[i]``'s tokens (its last one not yet cached)."""
        ...

    def release(self, seq_id: str) -> None:
        """The sequence ended (or was preempted): forget what is held for it."""
        ...


class NgramProposer:
    """Prompt lookup over each sequence's own tokens (pdserve.spec.ngram); keeps no state."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [
            propose_ngram(s.token_ids, k, self.n_min, self.n_max) if k else []
            for s, k in zip(seqs, ks, strict=True)
        ]

    def release(self, seq_id: str) -> None:
        pass
