"""What an engine reports of its live requests: counts and oldest age per state, its load."""

from __future__ import annotations

import time
from collections.abc import Iterable

from pdserve.engine.request import Request, RequestState

LIVE_STATES = tuple(s for s in RequestState if s is not RequestState.FINISHED)


def count_by_state(requests: Iterable[Request]) -> dict[str, int]:
    counts = {s.value: 0 for s in LIVE_STATES}
    for req in requests:
        counts[req.state.value] += 1
    return counts


def oldest_age_by_state(requests: Iterable[Request]) -> dict[str, float]:
    now = time.monotonic()
    ages = {s.value: 0.0 for s in LIVE_STATES}
    for req in requests:
        ages[req.state.value] = max(ages[req.state.value], now - req.state_entered)
    return ages
