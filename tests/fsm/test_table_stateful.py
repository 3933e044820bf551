"""Random interleavings of every trigger, abort, expiry and shutdown on several rooms at once.

The loop runs on a manual clock, so real deadline timers (armed, cancelled, stale) fire exactly
when the test advances time: no sleeps, no flakiness. A small reference model predicts which
triggers must be accepted; invariants check what no interleaving may ever break.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from transitions import MachineError

from pdserve.fsm import (
    TRIGGERS,
    DuplicateRoomError,
    Room,
    RoomDeadlines,
    RoomOutcome,
    RoomSide,
    RoomTable,
)

from .conftest import ManualClockLoop

ROOM_IDS = ("r0", "r1", "r2", "r3")
PEERS = (None, "decode-0@a", "decode-1@b")
# Whole seconds on a manual clock keep deadline arithmetic exact.
DEADLINES = RoomDeadlines(bootstrapping_s=3.0, waiting_for_input_s=5.0, transferring_s=4.0)
DEADLINE_BY_STATE = DEADLINES.by_state()
NEXT_STATE = {
    ("Bootstrapping", "bootstrapped"): "WaitingForInput",
    ("WaitingForInput", "begin_transfer"): "Transferring",
    ("Transferring", "chunk_sent"): "Transferring",
    ("Transferring", "transfer_done"): "Success",
    ("Bootstrapping", "fail"): "Failed",
    ("WaitingForInput", "fail"): "Failed",
    ("Transferring", "fail"): "Failed",
}


class RoomTableModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = ManualClockLoop()
        self.released: Counter[int] = Counter()
        self.table = RoomTable(
            RoomSide.SENDER, DEADLINES, on_release=self._on_release, loop=self.loop
        )
        self.all_rooms: list[Room] = []
        self.expected: dict[str, tuple[str, float]] = {}  # live id -> (state, deadline_at)
        self.outcomes: dict[int, RoomOutcome] = {}

    def _on_release(self, room: Room) -> None:
        # Release happens after removal and before the waiter hears the outcome.
        assert room.is_terminal and not self.table.deadline_queues.is_armed(room)
        assert self.table.get(room.room_id) is not room
        assert not room.done.done()
        self.released[id(room)] += 1

    def _apply(self, room_id: str, trigger: str) -> str | None:
        """Advance the reference model; returns the destination or None when invalid."""
        state = self.expected.get(room_id, ("Gone", 0.0))[0]
        dest = NEXT_STATE.get((state, trigger))
        if dest is None:
            return None
        if dest in ("Success", "Failed"):
            del self.expected[room_id]
        elif dest != state:
            self.expected[room_id] = (dest, self.loop.now + DEADLINE_BY_STATE[dest])
        return dest

    @rule(room_id=st.sampled_from(ROOM_IDS), peer=st.sampled_from(PEERS))
    def create(self, room_id: str, peer: str | None) -> None:
        if room_id in self.expected:
            with pytest.raises(DuplicateRoomError):
                self.table.create(room_id, peer=peer)
            return
        room = self.table.create(room_id, request_id=f"req-{room_id}", peer=peer, page_ids=[1])
        self.all_rooms.append(room)
        self.expected[room_id] = ("Bootstrapping", self.loop.now + DEADLINES.bootstrapping_s)

    @rule(
        room_id=st.sampled_from(ROOM_IDS),
        trigger=st.sampled_from((*TRIGGERS, "to_Success", "to_Failed")),
    )
    def fire(self, room_id: str, trigger: str) -> None:
        reason = "aborted" if trigger == "fail" else None
        accepted = self.table.fire(room_id, trigger, reason)
        assert accepted == (self._apply(room_id, trigger) is not None)

    @rule(room_id=st.sampled_from(ROOM_IDS))
    def expire_now(self, room_id: str) -> None:
        state = self.expected.get(room_id, ("Gone", 0.0))[0]
        room = self.table.get(room_id)
        assert self.table.expire(room_id) == (self._apply(room_id, "fail") is not None)
        if room is not None:
            assert room.reason == f"timeout:{state}"

    @rule(seconds=st.sampled_from((1.0, 2.0, 4.0, 6.0)))
    def advance_clock(self, seconds: float) -> None:
        now = self.loop.now + seconds
        due = [rid for rid, (_, deadline) in self.expected.items() if deadline <= now]
        self.loop.advance(seconds)  # every deadline now due expires, no others
        for room_id in due:
            assert self._apply(room_id, "fail") == "Failed"

    @rule(peer=st.sampled_from(PEERS[1:]))
    def fail_peer(self, peer: str) -> None:
        bound = sorted(r.room_id for r in self.table.rooms() if r.peer == peer)
        assert sorted(self.table.fail_peer(peer, "peer_lost")) == bound
        for room_id in bound:
            self._apply(room_id, "fail")

    @rule(room_id=st.sampled_from(ROOM_IDS), peer=st.sampled_from(PEERS[1:]))
    def bind_peer(self, room_id: str, peer: str) -> None:
        self.table.bind_peer(room_id, peer)
        room = self.table.get(room_id)
        assert room is None or room.peer == peer

    @precondition(lambda self: len(self.all_rooms) > 3)
    @rule()
    def close(self) -> None:
        self.table.close()
        self.expected.clear()

    @precondition(lambda self: any(r.is_terminal for r in self.all_rooms))
    @rule(data=st.data())
    def poke_finished_room_directly(self, data: st.DataObject) -> None:
        # Even bypassing the table, the machine has no way out of Success/Failed.
        room = data.draw(st.sampled_from([r for r in self.all_rooms if r.is_terminal]))
        state = room.state
        for trigger in TRIGGERS:
            with pytest.raises(MachineError):
                self.table.machine.events[trigger].trigger(room)
        assert room.state == state

    @invariant()
    def rooms_are_consistent(self) -> None:
        for room in self.all_rooms:
            assert room.is_terminal == room.done.done()
            assert self.released[id(room)] == (1 if room.is_terminal else 0)
            if room.is_terminal:
                outcome = room.done.result()
                assert self.outcomes.setdefault(id(room), outcome) is outcome
                assert room.state == outcome.state.value and room.reason == outcome.reason
                assert self.table.get(room.room_id) is not room
                assert room.deadline_at is None
                assert not self.table.deadline_queues.is_armed(room)
            else:
                assert self.table.get(room.room_id) is room
                assert self.table.deadline_queues.is_armed(room)
                assert (room.state, room.deadline_at) == self.expected[room.room_id]

    @invariant()
    def table_holds_only_live_rooms(self) -> None:
        assert not any(room.is_terminal for room in self.table.rooms())
        assert sorted(self.expected) == sorted(r.room_id for r in self.table.rooms())
        stats = self.table.stats
        assert stats.created == len(self.all_rooms)
        finished = sum(1 for room in self.all_rooms if room.is_terminal)
        assert stats.succeeded + stats.failed == finished
        assert sum(self.table.count_by_state().values()) == len(self.table)
        # Every live room holds exactly one deadline, and the timer is set while any is armed.
        assert len(self.table.deadline_queues) == len(self.table)
        wakeup = self.table.deadline_queues.next_wakeup_at
        if self.expected:
            earliest = min(deadline for _, deadline in self.expected.values())
            assert wakeup is not None and wakeup <= earliest

    def teardown(self) -> None:
        self.table.close()
        self.loop.close()


RoomTableModel.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_room_table_random_interleavings = RoomTableModel.TestCase
