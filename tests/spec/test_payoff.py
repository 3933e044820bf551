"""The payoff policy: plain first, then speculate while it measures faster; once slower, plain
steps with a re-measuring speculative step now and then; each batch size on its own."""

from __future__ import annotations

from pdserve.spec.payoff import PROBE_EVERY, PayoffPolicy


def test_a_batch_size_is_measured_plain_first_then_speculates() -> None:
    p = PayoffPolicy()
    assert not p.should_speculate(1)
    p.on_plain(1, 0.1)  # 10 tok/s
    assert p.should_speculate(1)
    p.on_spec(1, 0.1, 3)  # 30 tok/s: keeps speculating, with a plain step now and then
    decisions = [p.should_speculate(1) for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(False) == 2 and not decisions[PROBE_EVERY - 2]


def test_slower_speculation_steps_aside_and_probes_again() -> None:
    p = PayoffPolicy()
    p.on_plain(8, 0.1)  # 80 tok/s
    p.on_spec(8, 0.5, 10)  # 20 tok/s
    decisions = [p.should_speculate(8) for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(True) == 2 and decisions[PROBE_EVERY - 1]
    assert not p.should_speculate(4)  # another batch size has its own measurements
    p.on_spec(8, 0.01, 10)  # acceptance rose: the average climbs back over plain
    for _ in range(10):
        p.on_spec(8, 0.01, 10)
    assert p.should_speculate(8)
