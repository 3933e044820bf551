"""One generation stream's grammar state: its next bitmask row, advanced per accepted token."""

from __future__ import annotations

import threading

import llguidance
import torch

from pdserve.grammar.filler import MaskFiller

# A fill is bounded by the parser's fuel limits (milliseconds); this only guards a wedged one.
FILL_TIMEOUT_S = 30.0


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: bit ``v % 32`` of word ``v // 32`` allows token ``v``."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """Wraps an ``llguidance.LLMatcher``; never rolls back (each accepted token is final).

    Ownership (one writer per state): the llguidance state belongs to the engine loop, which
    advances it (:meth:`accept`), except while a fill it started (:meth:`prefetch`) runs on
    the filler's thread. The loop touches the state again only once that fill has ended:
    :meth:`accept` waits for it first (in practice it has ended: the step that sampled the
    token waited for its mask), and :attr:`is_done` / :attr:`error` read values taken at the
    last accept. The runner thread only reads the finished row (:meth:`bitmask`); the engine
    never accepts for a sequence while it is in the step in flight, so the row it reads stays
    put until the step returns.

    ``filler`` None: no background fill; :meth:`bitmask` fills on the calling thread (the
    serial path).
    """

    def __init__(
        self, matcher: llguidance.LLMatcher, vocab_size: int, filler: MaskFiller | None = None
    ) -> None:
        self._llmatcher = matcher
        self.vocab_size = vocab_size
        self._filler = filler
        self._row = torch.empty(bitmask_words(vocab_size), dtype=torch.int32)
        self._row_is_valid = False  # the row is the mask of the current state
        self._idle = threading.Event()  # set: no fill owns the state
        self._idle.set()
        self._fill_error: str | None = None
        self._snapshot()

    # ----- engine loop ------------------------------------------------------------------------

    def prefetch(self) -> None:
        """Start filling the next mask in the background (a no-op when it is known, in flight,
        not needed, or there is no filler). Called by the state's owner, after an accept;
        :func:`prefetch_all` does it for many with one hand-off."""
        if self._claim_for_fill():
            assert self._filler is not None
            self._filler.submit([self])

    def _claim_for_fill(self) -> bool:
        """True when a background fill is due: the state is then the filler's."""
        if (
            self._filler is None
            or self._row_is_valid
            or not self._idle.is_set()
            or self._is_done
            or self.error is not None
        ):
            return False
        self._idle.clear()
        return True

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False when the grammar rejects it (or its fill
        failed: the token was sampled from no mask)."""
        return self._take_back() and self._advanced(self._llmatcher.consume_token(token_id))

    def accept_all(self, token_ids: list[int]) -> bool:
        return self._take_back() and self._advanced(self._llmatcher.consume_tokens(token_ids))

    @property
    def is_done(self) -> bool:
        """The grammar accepts nothing more (a complete match, or EOS consumed)."""
        return self._is_done

    @property
    def error(self) -> str | None:
        return self._fill_error or self._error

    def _take_back(self) -> bool:
        return self._fill_error is None and self._wait_idle()

    def _wait_idle(self) -> bool:
        """Wait for a fill in flight; False (and the fill's error recorded) when it wedged."""
        # is_set first: Event.wait takes its condition's lock even when the event is set.
        if self._idle.is_set() or self._idle.wait(FILL_TIMEOUT_S):
            return True
        self._fill_error = f"bitmask fill took over {FILL_TIMEOUT_S:g} s"
        return False

    def _advanced(self, ok: bool) -> bool:
        self._row_is_valid = False
        self._snapshot()
        return ok

    def _snapshot(self) -> None:
        # Read while the loop owns the state, so that these never race a background fill.
        m = self._llmatcher
        self._is_done = m.is_stopped()
        self._error = m.get_error() if m.is_error() else None

    # ----- runner thread ------------------------------------------------------------------

    @property
    def bitmask_words(self) -> int:
        return self._row.numel()

    def bitmask(self) -> torch.Tensor:
        """The next tokens' bitmask, ``(bitmask_words,)`` int32 on the CPU (read only, valid
        until the next accept): waits for the prefetched fill, or fills now when none was
        started. A matcher in error allows nothing but EOS; a failed fill allows everything
        (the request then fails at its accept, its neighbours sample as usual)."""
        if not self._wait_idle():
            return torch.full_like(self._row, -1)
        if not self._row_is_valid:
            self.fill_now()
        return self._row

    # ----- the filler's thread (or the runner's, inline): the state is the caller's here ----

    @property
    def llguidance_matcher(self) -> llguidance.LLMatcher:
        """For the filler only, between ``submit`` and :meth:`end_fill`."""
        return self._llmatcher

    def fill_now(self) -> None:
        """Fill the own row from the current state, then :meth:`end_fill`."""
        error = None
        try:
            row = self._row
            self._llmatcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        except Exception as exc:  # its own request fails (at accept), never the step
            error = f"bitmask fill failed: {exc}"
        self.end_fill(error)

    def end_fill(self, error: str | None, row: torch.Tensor | None = None) -> None:
        """The fill is over: ``row`` (a filled row of the filler's) or the own row is the mask."""
        if row is not None:
            self._row = row
        if error is not None:
            self._fill_error = error
            self._row = torch.full_like(self._row, -1)
        self._row_is_valid = True
        self._idle.set()  # last: the loop and the runner may read from here on


def prefetch_all(matchers: list[GrammarMatcher]) -> None:
    """:meth:`GrammarMatcher.prefetch` for each, with one hand-off per filler: a step's
    constrained rows wake the filler once and are filled in one (parallel) round."""
    by_filler: dict[int, tuple[MaskFiller, list[GrammarMatcher]]] = {}
    for m in matchers:
        if m._claim_for_fill():
            assert m._filler is not None
            by_filler.setdefault(id(m._filler), (m._filler, []))[1].append(m)
    for filler, claimed in by_filler.values():
        filler.submit(claimed)
