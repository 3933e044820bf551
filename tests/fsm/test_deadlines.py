"""Per-state FIFO deadlines behind one loop timer (pdserve/fsm/deadlines.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve.fsm import Room, RoomDeadlines, RoomSide
from pdserve.fsm.deadlines import EXPIRY_SLACK_S, DeadlineQueues

from .conftest import ManualClockLoop

B, W, T = "Bootstrapping", "WaitingForInput", "Transferring"
DEADLINES = RoomDeadlines(bootstrapping_s=3.0, waiting_for_input_s=10.0, transferring_s=5.0)


class Harness:
    def __init__(self, loop: ManualClockLoop) -> None:
        self.loop = loop
        self.expired: list[str] = []
        self.queues = DeadlineQueues(DEADLINES, self._on_expired)
        self.queues.bind(loop)

    def _on_expired(self, room: Room) -> None:
        assert not self.queues.is_armed(room)  # already off its queue when reported
        self.expired.append(room.room_id)

    def room(self, room_id: str, state: str) -> Room:
        room = Room(room_id, RoomSide.SENDER, self.loop.create_future(), self.loop.now)
        self.queues.arm(room, state, self.loop.now)
        return room


@pytest.fixture
def harness() -> Iterator[Harness]:
    loop = ManualClockLoop()
    yield Harness(loop)
    loop.close()


def test_rooms_expire_in_entry_order_at_their_deadline(harness: Harness) -> None:
    loop = harness.loop
    harness.room("a", B)
    loop.now += 1.0
    second = harness.room("b", B)
    assert second.deadline_at == loop.now + 3.0
    assert harness.queues.next_wakeup_at == loop.now - 1.0 + 3.0
    loop.advance(1.9)  # 2.9 s after "a": nothing due
    assert harness.expired == [] and len(harness.queues) == 2
    loop.advance(0.1)
    assert harness.expired == ["a"] and harness.queues.next_wakeup_at == second.deadline_at
    loop.advance(5.0)
    assert harness.expired == ["a", "b"]
    assert len(harness.queues) == 0 and harness.queues.next_wakeup_at is None


def test_all_due_rooms_of_every_state_expire_in_one_wakeup(harness: Harness) -> None:
    for i in range(3):
        harness.room(f"b{i}", B)
        harness.room(f"t{i}", T)
    harness.room("w", W)
    harness.loop.advance(6.0)
    assert sorted(harness.expired) == ["b0", "b1", "b2", "t0", "t1", "t2"]
    assert len(harness.queues) == 1 and harness.queues.next_wakeup_at == 1010.0


def test_shorter_deadline_pulls_the_timer_earlier(harness: Harness) -> None:
    harness.room("w", W)
    assert harness.queues.next_wakeup_at == 1010.0
    harness.room("b", B)
    assert harness.queues.next_wakeup_at == 1003.0
    harness.loop.advance(3.0)
    assert harness.expired == ["b"] and harness.queues.next_wakeup_at == 1010.0


def test_disarmed_head_is_skipped_and_timer_moves_on(harness: Harness) -> None:
    first = harness.room("first", T)
    harness.loop.now += 2.0
    second = harness.room("second", T)
    harness.queues.disarm(first, T)
    assert first.deadline_at is None and not harness.queues.is_armed(first)
    assert harness.queues.next_wakeup_at == 1005.0  # stays early: disarming is just a pop
    harness.loop.advance(3.0)  # the early wakeup finds nothing due and re-arms
    assert harness.expired == [] and harness.queues.next_wakeup_at == second.deadline_at
    harness.loop.advance(2.0)
    assert harness.expired == ["second"]


def test_deadline_within_slack_counts_as_due(harness: Harness) -> None:
    harness.room("a", B)
    # asyncio itself never wakes early, uvloop (ms ticks) can: call the wakeup by hand.
    harness.queues.close()
    harness.loop.now += 3.0 - EXPIRY_SLACK_S / 2
    harness.queues._on_timer()
    assert harness.expired == ["a"]


def test_close_cancels_the_timer(harness: Harness) -> None:
    harness.room("a", B)
    harness.queues.close()
    assert harness.queues.next_wakeup_at is None
    harness.loop.advance(10.0)
    assert harness.expired == []


def test_rooms_armed_during_a_wakeup_wait_for_the_next(harness: Harness) -> None:
    tiny = RoomDeadlines(bootstrapping_s=EXPIRY_SLACK_S / 10)
    reopened: list[str] = []

    def reopen(room: Room) -> None:
        # A release callback that opens a new room with an already-due deadline must not
        # keep the wakeup looping forever.
        reopened.append(room.room_id)
        if len(reopened) > 10:  # an unbounded wakeup would loop here; stop so the test fails
            return
        fresh = Room(f"{room.room_id}+", RoomSide.SENDER, harness.loop.create_future(), 0.0)
        queues.arm(fresh, B, harness.loop.now)

    queues = DeadlineQueues(tiny, reopen)
    queues.bind(harness.loop)
    queues.arm(Room("a", RoomSide.SENDER, harness.loop.create_future(), 0.0), B, harness.loop.now)
    harness.loop.advance(1.0)
    assert reopened[0] == "a" and len(reopened) <= 2
    assert len(queues) == 1 and queues.next_wakeup_at is not None
    queues.close()
