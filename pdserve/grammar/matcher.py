"""One generation stream's grammar state: fills its bitmask row, advances per accepted token."""

from __future__ import annotations

import llguidance
import torch


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: bit ``v % 32`` of word ``v // 32`` allows token ``v``."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """Wraps an ``llguidance.LLMatcher``; never rolls back (each accepted token is final).

    Written by the engine loop (:meth:`accept`) and read by the runner thread
    (:meth:`fill_bitmask`); the engine never does both at once for one sequence.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into ``row``: contiguous CPU int32 of
        :func:`bitmask_words` words. A matcher in error allows nothing but EOS."""
        assert row.dtype == torch.int32 and row.is_contiguous() and not row.is_cuda
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False when the grammar rejects it."""
        return self._matcher.consume_token(token_id)

    def accept_all(self, token_ids: list[int]) -> bool:
        return self._matcher.consume_tokens(token_ids)

    @property
    def is_done(self) -> bool:
        """The grammar accepts nothing more (a complete match, or EOS consumed)."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None
