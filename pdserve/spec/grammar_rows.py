"""Structured outputs in a verify step: each drafted row's grammar mask, then a rollback.

Row ``j`` of a constrained request must be masked as the plain step at that position would be:
by the matcher's state after drafts ``0 .. j-1``. On the runner thread (the engine accepts
nothing for a sequence while its step runs, and the fill in flight is waited for first), the
llguidance matcher consumes the drafts one by one, the mask after each is computed into a row
of its own, and the matcher rolls back as many tokens: its state, its current mask and its
snapshot (``is_done``, ``error``) are as before. Drafts the grammar does not allow are cut at the
first one (the plain sampler, masked, could never pick it). The engine then advances the matcher
by the accepted tokens as plain steps would (``StepOutputs.commit_run``).
"""

from __future__ import annotations

import torch

from pdserve.grammar.matcher import GrammarMatcher


class FixedMask:
    """A precomputed mask row; stands for the matcher where the sampler asks for a bitmask."""

    def __init__(self, row: torch.Tensor, vocab_size: int) -> None:
        self._row = row
        self.vocab_size = vocab_size

    def bitmask(self) -> torch.Tensor:
        return self._row


def draft_masks(matcher: GrammarMatcher, drafts: list[int]) -> tuple[list[int], list[FixedMask]]:
    """The drafts the grammar allows in a row, and the mask after each of them."""
    matcher.bitmask()  # waits for a fill in flight: from here the state is this thread's
    llm = matcher.llguidance_matcher
    if matcher.error is not None or llm.is_stopped() or not drafts:
        return [], []
    kept = drafts[: llm.validate_tokens(drafts)]
    masks: list[FixedMask] = []
    consumed = 0
    for tok in kept:
        if not llm.consume_token(tok):
            break
        consumed += 1
        row = torch.empty(matcher.bitmask_words, dtype=torch.int32)
        llm.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        masks.append(FixedMask(row, matcher.vocab_size))
    if consumed:
        llm.rollback(consumed)
    return kept[:consumed], masks
