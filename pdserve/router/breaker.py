"""Per-worker circuit breaker: closed -> open after N consecutive failures -> half-open after a
reset time (one trial request) -> closed on success, open again on failure.

The breaker is written only from the event loop (the dispatcher reports outcomes); the clock is
injectable so tests can drive the reset time without sleeping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


class CircuitBreaker:
    """Decides whether a worker may get new requests, from the outcomes of past ones."""

    def __init__(
        self,
        name: str,
        max_failures: int,
        reset_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.max_failures = max_failures
        self.reset_s = reset_s
        self._clock = clock
        self._is_open = False
        self._opened_at = 0.0
        self._num_failures = 0  # consecutive
        self._is_trial_in_flight = False
        self.num_opens = 0

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half_open`` (open whose reset time has passed)."""
        if not self._is_open:
            return CLOSED
        if self._clock() - self._opened_at >= self.reset_s:
            return HALF_OPEN
        return OPEN

    @property
    def num_failures(self) -> int:
        return self._num_failures

    def can_attempt(self) -> bool:
        """True if a new request may be sent now (half-open allows one trial at a time)."""
        state = self.state
        if state == CLOSED:
            return True
        return state == HALF_OPEN and not self._is_trial_in_flight

    def on_attempt(self) -> None:
        """Called when a request is sent; in half-open it claims the single trial slot."""
        if self.state == HALF_OPEN:
            self._is_trial_in_flight = True
            logger.debug("breaker %s: half_open trial started", self.name)

    def record_success(self) -> None:
        """The worker answered properly: closes the breaker and resets the failure streak."""
        if self._is_open:
            logger.info("breaker %s: %s -> closed (trial succeeded)", self.name, self.state)
        self._is_open = False
        self._is_trial_in_flight = False
        self._num_failures = 0

    def record_failure(self, reason: str) -> bool:
        """Count a failure; returns True when this failure opened the breaker."""
        self._num_failures += 1
        was_trial = self._is_trial_in_flight
        self._is_trial_in_flight = False
        if self._is_open and not was_trial:
            return False  # a request sent before the breaker opened; it is already open
        if was_trial or self._num_failures >= self.max_failures:
            self._is_open = True
            self._opened_at = self._clock()
            self.num_opens += 1
            logger.warning(
                "breaker %s: -> open after %d consecutive failures (last: %s)",
                self.name,
                self._num_failures,
                reason,
            )
            return True
        return False

    def release(self) -> None:
        """A request ended without a verdict on the worker (cancelled, client left)."""
        self._is_trial_in_flight = False

    def reset(self, reason: str) -> None:
        """Forget history, e.g. because the worker restarted with a new incarnation."""
        if self._is_open or self._num_failures:
            logger.info("breaker %s: %s -> closed (%s)", self.name, self.state, reason)
        self._is_open = False
        self._is_trial_in_flight = False
        self._num_failures = 0
