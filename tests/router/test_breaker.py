"""Circuit breaker state machine, driven by a fake clock."""

from __future__ import annotations

import pytest

from pdserve.router.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def breaker(clock: FakeClock) -> CircuitBreaker:
    return CircuitBreaker("w", max_failures=3, reset_s=5.0, clock=clock)


def fail(breaker: CircuitBreaker, times: int) -> list[bool]:
    opened = []
    for _ in range(times):
        breaker.on_attempt()
        opened.append(breaker.record_failure("boom"))
    return opened


def test_opens_after_consecutive_failures_only(breaker):
    assert fail(breaker, 2) == [False, False]
    breaker.on_attempt()
    breaker.record_success()  # resets the streak
    assert fail(breaker, 2) == [False, False] and breaker.state == CLOSED
    assert fail(breaker, 1) == [True]
    assert breaker.state == OPEN and not breaker.can_attempt() and breaker.num_opens == 1


def test_open_becomes_half_open_after_reset_time_and_allows_one_trial(breaker, clock):
    fail(breaker, 3)
    clock.now += 4.9
    assert breaker.state == OPEN and not breaker.can_attempt()
    clock.now += 0.2
    assert breaker.state == HALF_OPEN and breaker.can_attempt()
    breaker.on_attempt()
    assert not breaker.can_attempt()  # a single trial at a time


def test_half_open_trial_success_closes(breaker, clock):
    fail(breaker, 3)
    clock.now += 5.0
    breaker.on_attempt()
    breaker.record_success()
    assert breaker.state == CLOSED and breaker.can_attempt() and breaker.num_failures == 0


def test_half_open_trial_failure_reopens_for_a_full_reset_time(breaker, clock):
    fail(breaker, 3)
    clock.now += 5.0
    breaker.on_attempt()
    assert breaker.record_failure("still broken") is True
    assert breaker.state == OPEN and breaker.num_opens == 2
    clock.now += 4.0
    assert breaker.state == OPEN
    clock.now += 1.0
    assert breaker.state == HALF_OPEN


def test_released_trial_frees_the_slot_without_a_verdict(breaker, clock):
    fail(breaker, 3)
    clock.now += 5.0
    breaker.on_attempt()
    breaker.release()
    assert breaker.state == HALF_OPEN and breaker.can_attempt()


def test_failures_of_requests_sent_before_opening_do_not_reopen(breaker):
    fail(breaker, 3)
    assert breaker.record_failure("late") is False
    assert breaker.num_opens == 1


def test_reset_closes_immediately(breaker):
    fail(breaker, 3)
    breaker.reset("new incarnation")
    assert breaker.state == CLOSED and breaker.num_failures == 0
