"""Bitmask fills off the step's critical path: one worker thread per process.

A constrained stream's next mask depends only on the tokens its matcher has accepted, so the
engine hands a step's matchers here as soon as their tokens are accepted (one hand-off per
step: :func:`~pdserve.grammar.matcher.prefetch_all`), and the fills run while the loop
schedules the next step and the runner computes its forward; the runner only waits for them
once the logits are ready. llguidance computes masks with the GIL released, so the fills
overlap Python work on the loop and the runner too.

The worker takes every matcher queued since its last round at once: two or more are filled
by llguidance's own parallel executor (Rust threads) into one scratch block, one by a direct
call. Each matcher then owns its finished row; a failure is recorded on its own matcher only.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Protocol

import llguidance
import torch

logger = logging.getLogger(__name__)


class Fillable(Protocol):
    """What the filler needs of a matcher (:class:`~pdserve.grammar.matcher.GrammarMatcher`)."""

    @property
    def bitmask_words(self) -> int: ...

    @property
    def llguidance_matcher(self) -> llguidance.LLMatcher: ...

    def fill_now(self) -> None:
        """Fill the mask on this thread and end the fill."""

    def end_fill(self, error: str | None, row: torch.Tensor | None = None) -> None:
        """The fill ended (``row``: the filled mask; ``error``: why there is none)."""


class MaskFiller:
    """Fills queued matchers' bitmasks on one daemon thread (started on first use)."""

    def __init__(self, name: str = "pdserve-grammar-fill") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[list[Fillable]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pid: int | None = None  # the process whose worker thread runs
        self._executor: llguidance.LLExecutor | None = None  # made on the first batch of 2+

    def submit(self, matchers: list[Fillable]) -> None:
        """Queue the fills of ``matchers``; each one's state is the worker's until its fill
        ends (:meth:`Fillable.end_fill`)."""
        if self._pid != os.getpid():  # first use, or a forked child (no thread, no Rust pool)
            with self._lock:
                if self._pid != os.getpid():
                    self._executor = None
                    threading.Thread(target=self._work, name=self._name, daemon=True).start()
                    self._pid = os.getpid()
        self._queue.put(matchers)

    def _work(self) -> None:
        while True:
            batch = list(self._queue.get())
            while True:  # everything queued meanwhile: one parallel round
                try:
                    batch += self._queue.get_nowait()
                except queue.Empty:
                    break
            try:
                self._fill(batch)
            except BaseException:  # never lose the thread: each matcher still ends its fill
                logger.exception("grammar bitmask fill round failed")
                for m in batch:
                    m.end_fill("bitmask fill failed")

    def _fill(self, batch: list[Fillable]) -> None:
        if len(batch) > 1 and self._fill_parallel(batch):
            return
        for m in batch:
            m.fill_now()

    def _fill_parallel(self, batch: list[Fillable]) -> bool:
        """All of ``batch`` by llguidance's executor; False (nothing ended) when it cannot."""
        words = batch[0].bitmask_words
        if any(m.bitmask_words != words for m in batch):
            return False  # matchers of different vocabularies: one by one
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        scratch = torch.empty((len(batch), words), dtype=torch.int32)
        try:
            self._executor.unsafe_compute_mask_ptr(
                [(m.llguidance_matcher, i) for i, m in enumerate(batch)],
                scratch.data_ptr(),
                words * 4,
                len(batch),
            )
        except Exception:  # e.g. a matcher that is not llguidance's: each alone isolates it
            return False
        for i, m in enumerate(batch):
            m.end_fill(None, scratch[i])
        return True


_shared: MaskFiller | None = None
_shared_lock = threading.Lock()


def shared_filler() -> MaskFiller:
    """The process's filler: one worker thread for every compiler and engine in it."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = MaskFiller()
        return _shared
