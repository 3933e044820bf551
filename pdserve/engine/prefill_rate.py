"""The engine's measured prefill rate: prompt tokens per second over its recent prefill steps.

A request whose prompt could not be prefilled within its own deadline at this rate is refused
at admission with the estimate (a 400), instead of running until its deadline kills it.
"""

from __future__ import annotations

from collections import deque


class PrefillRate:
    """Tokens / seconds summed over the last ``window`` steps that computed prompt tokens (a
    mixed step's decode rows ride along: they are a small share of a step with a chunk)."""

    def __init__(self, window: int = 16) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)
        self._tokens = 0
        self._seconds = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        if len(self._steps) == self._steps.maxlen:
            old_tokens, old_seconds = self._steps[0]
            self._tokens -= old_tokens
            self._seconds -= old_seconds
        self._steps.append((num_tokens, seconds))
        self._tokens += num_tokens
        self._seconds += seconds

    @property
    def tokens_per_s(self) -> float | None:
        """None until a prefill step was measured."""
        if not self._steps or self._seconds <= 0:
            return None
        return self._tokens / self._seconds

    def estimate_s(self, num_tokens: int) -> float | None:
        """Seconds to prefill ``num_tokens`` at the measured rate (None: nothing measured)."""
        rate = self.tokens_per_s
        return None if rate is None else num_tokens / rate
