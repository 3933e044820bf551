"""Decode thread choice: more threads only when they pay, measured side by side."""

from __future__ import annotations

import pytest

from pdserve import thread_tuning
from pdserve.thread_tuning import ThreadChoice, choose_threads, time_candidates


@pytest.mark.parametrize(
    ("step_s", "expected"),
    [
        ({1: 0.010, 2: 0.0102}, 1),  # no gain: keep the core for the server
        ({1: 0.010, 2: 0.008}, 1),  # 1.25x: not enough
        ({1: 0.010, 2: 0.0075}, 2),  # 1.33x
        ({1: 0.010, 2: 0.006, 4: 0.005}, 2),  # 4 threads are only 1.2x over 2
        ({1: 0.010, 2: 0.009, 4: 0.004}, 4),  # judged against the current choice
        ({2: 0.005}, 2),
        ({1: 0.045, 2: 0.046}, 2),  # a long one-thread step: a busy machine hid the gain
    ],
)
def test_more_threads_are_kept_only_when_at_least_1_3x_faster_or_the_step_is_long(
    step_s: dict[int, float], expected: int
) -> None:
    assert choose_threads(step_s) == expected


def test_candidates_alternate_trial_by_trial_and_the_best_time_is_kept(monkeypatch) -> None:
    calls: list[int] = []
    now = [0.0]
    durations = {1: [5.0, 3.0, 4.0], 2: [2.0, 6.0, 2.5]}

    def set_threads(n: int) -> None:
        calls.append(n)

    def step() -> None:  # advances a fake clock by this trial's duration for the current count
        n = calls[-1]
        now[0] += durations[n][calls.count(n) - 1]

    monkeypatch.setattr(thread_tuning.time, "perf_counter", lambda: now[0])
    best = time_candidates(step, set_threads, [1, 2], num_trials=3)
    assert calls == [1, 2, 1, 2, 1, 2]
    assert best == {1: 3.0, 2: 2.0}


def test_choice_description_names_every_candidate() -> None:
    text = ThreadChoice(1, {1: 0.002, 2: 0.0021}).describe()
    assert text.startswith("decode threads 1") and "1 thread(s) 2.00 ms" in text
    assert "2 thread(s) 2.10 ms" in text
