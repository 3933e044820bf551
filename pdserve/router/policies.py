"""Load-balancing policies: pick one worker among the available candidates of one role.

Each role gets its own policy instance (so round robin cycles per role). Candidates are passed
in a stable order (registration order); policies never see unavailable workers. ``key`` is the
request's prompt text where the role benefits from prefix affinity (None otherwise); only
``cache_aware`` (pdserve.router.cache_aware) reads it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from pdserve.router.cache_aware import CacheAwareConfig, CacheAwarePolicy
from pdserve.router.config import POLICY_NAMES
from pdserve.router.workers import Worker


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Worker], key: str | None = None) -> Worker:
        """Pick one of ``candidates`` (non-empty) for a request whose prompt starts ``key``."""
        ...


class RoundRobinPolicy:
    """Cycles through the candidates in order; a changing candidate set keeps cycling."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[Worker], key: str | None = None) -> Worker:
        worker = candidates[self._next % len(candidates)]
        self._next += 1
        return worker


class RandomPolicy:
    """Uniform choice, from an injectable (seedable) RNG."""

    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, candidates: Sequence[Worker], key: str | None = None) -> Worker:
        return self._rng.choice(candidates)


class PowerOfTwoPolicy:
    """Power of two choices: sample two distinct candidates, keep the less loaded one
    (:meth:`Worker.load_score`: in-flight and reported requests, then free KV pages; ties go
    to the first sampled, which is random)."""

    name = "power_of_two"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, candidates: Sequence[Worker], key: str | None = None) -> Worker:
        if len(candidates) == 1:
            return candidates[0]
        first, second = self._rng.sample(list(candidates), 2)
        return second if second.load_score() < first.load_score() else first


class LeastLoadedPolicy:
    """The least loaded candidate by :meth:`Worker.load_score`; ties go round robin, so equal
    workers (an idle fleet) still share the traffic."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[Worker], key: str | None = None) -> Worker:
        scores = [w.load_score() for w in candidates]
        best = min(scores)
        tied = [w for w, score in zip(candidates, scores, strict=True) if score == best]
        worker = tied[self._next % len(tied)]
        self._next += 1
        return worker


class AutoPolicy:
    """The default: ``cache_aware`` while more than one prefill is available, ``round_robin``
    otherwise. With several prefills, where a prompt's prefix was computed before decides its
    TTFT: on 2 prefills x 2 decodes and a shared-prefix load, cache_aware had 0.85 of prompt
    tokens cached at the prefills, round robin 0 and power of two 0.39, and a TTFT p50 0.16x
    round robin's (bench/routing_compare.py, docs/benchmarks.md)."""

    name = "auto"

    def __init__(self, cache_aware: CacheAwareConfig | None, num_prefills: Callable[[], int]):
        self._affine = CacheAwarePolicy(cache_aware)
        self._plain = RoundRobinPolicy()
        self._num_prefills = num_prefills

    def choose(self, candidates: Sequence[Worker], key: str | None = None) -> Worker:
        policy = self._affine if self._num_prefills() > 1 else self._plain
        return policy.choose(candidates, key)


def make_policy(
    name: str,
    rng: random.Random,
    cache_aware: CacheAwareConfig | None = None,
    num_prefills: Callable[[], int] = lambda: 1,
) -> Policy:
    """A fresh policy instance by its config name (one per worker role); ``num_prefills``
    counts the prefills available now (``auto`` reads it at each choice)."""
    if name == "auto":
        return AutoPolicy(cache_aware, num_prefills)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "random":
        return RandomPolicy(rng)
    if name == "power_of_two":
        return PowerOfTwoPolicy(rng)
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "cache_aware":
        return CacheAwarePolicy(cache_aware)
    raise ValueError(f"unknown policy {name!r}; expected one of {POLICY_NAMES}")
