"""Load-balancing policies choose as documented."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pdserve.router.breaker import CircuitBreaker
from pdserve.router.policies import (
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    make_policy,
)
from pdserve.router.workers import Worker


def workers(*loads: int) -> list[Worker]:
    out = []
    for i, load in enumerate(loads):
        url = f"http://127.0.0.1:{9000 + i}"
        w = Worker(url=url, role="decode", breaker=CircuitBreaker(url, 3, 5.0))
        w.num_in_flight = load
        out.append(w)
    return out


def test_round_robin_cycles_in_order():
    ws = workers(0, 0, 0)
    policy = RoundRobinPolicy()
    assert [policy.choose(ws).url for _ in range(6)] == [w.url for w in ws] * 2


def test_round_robin_keeps_cycling_when_candidates_shrink():
    ws = workers(0, 0, 0)
    policy = RoundRobinPolicy()
    policy.choose(ws)
    two = ws[:2]
    picks = Counter(policy.choose(two).url for _ in range(10))
    assert picks == {ws[0].url: 5, ws[1].url: 5}


def test_random_is_reproducible_with_a_seed_and_covers_all():
    ws = workers(0, 0, 0, 0)

    def draw(seed: int) -> list[str]:
        policy = RandomPolicy(random.Random(seed))
        return [policy.choose(ws).url for _ in range(400)]

    picks = draw(7)
    assert picks == draw(7) and picks != draw(8)
    counts = Counter(picks)
    assert set(counts) == {w.url for w in ws}
    assert all(60 <= c <= 140 for c in counts.values())  # ~100 each


def test_power_of_two_picks_the_less_loaded_of_two():
    ws = workers(5, 1)
    policy = PowerOfTwoPolicy(random.Random(0))
    assert {policy.choose(ws).url for _ in range(50)} == {ws[1].url}


def test_power_of_two_never_picks_the_most_loaded_of_three():
    ws = workers(0, 9, 0)
    policy = PowerOfTwoPolicy(random.Random(0))
    picks = Counter(policy.choose(ws).url for _ in range(300))
    assert ws[1].url not in picks
    assert picks[ws[0].url] > 50 and picks[ws[2].url] > 50  # ties are spread, not pinned


def test_power_of_two_single_candidate():
    ws = workers(3)
    assert PowerOfTwoPolicy(random.Random(0)).choose(ws) is ws[0]


def test_make_policy_by_name():
    rng = random.Random(0)
    assert isinstance(make_policy("round_robin", rng), RoundRobinPolicy)
    assert isinstance(make_policy("random", rng), RandomPolicy)
    assert isinstance(make_policy("power_of_two", rng), PowerOfTwoPolicy)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("least_bananas", rng)


def test_auto_is_prefix_affine_once_there_are_several_prefills_and_round_robin_before():
    ws = workers(0, 0)
    num_prefills = [1]
    policy = make_policy("auto", random.Random(0), num_prefills=lambda: num_prefills[0])
    assert policy.name == "auto"
    # One prefill: round robin, whatever the prompt.
    assert [policy.choose(ws, "same prompt " * 20).url for _ in range(4)] == [w.url for w in ws] * 2
    num_prefills[0] = 2  # a second prefill: the prompt's prefix decides (cache_aware)
    first = policy.choose(ws, "a shared prefix " * 20)
    assert all(policy.choose(ws, "a shared prefix " * 20) is first for _ in range(4))


def test_the_router_default_is_auto():
    from pdserve.router.config import RouterConfig  # noqa: PLC0415

    assert RouterConfig().policy == "auto"
