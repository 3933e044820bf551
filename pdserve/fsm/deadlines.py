"""Per-state room deadlines: one FIFO per state behind a single event-loop timer.

Each table has one fixed deadline per state, and loop time never goes back, so the rooms of a
state expire in the order they entered it: an insertion-ordered dict per state is already sorted
by deadline. Arming is a dict insert, disarming a dict pop, and one ``loop.call_at`` timer sits at
the earliest head. A ``TimerHandle`` per room and state instead costs 16-33 us per room life at
2k-10k live rooms (handle churn, Python-level heap compares, heap rebuilds after cancels;
measured with bench/fsm_bench.py), which alone would break the 50 us budget.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from pdserve.fsm.room import Room, RoomDeadlines

# asyncio runs a timer up to one clock resolution early, and uvloop's clock ticks in ms: a room
# this close to its deadline counts as due, so an early wakeup cannot spin on a not-quite-due head.
EXPIRY_SLACK_S = 1e-3


class DeadlineQueues:
    """Armed deadlines of live rooms, keyed by state; calls ``on_expired(room)`` when one passes.

    ``on_expired`` must take the room out of its state (the table fails it); the room is already
    off its queue when called. Single writer: the table, on its event loop.
    """

    def __init__(self, deadlines: RoomDeadlines, on_expired: Callable[[Room], None]) -> None:
        self._seconds = deadlines.by_state()
        self._queues: dict[str, dict[str, Room]] = {state: {} for state in self._seconds}
        self._on_expired = on_expired
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Use ``loop`` for the timer (the table binds it at its first room)."""
        self._loop = loop

    def arm(self, room: Room, state: str, now: float) -> None:
        """Start ``state``'s deadline for ``room`` (which just entered it at ``now``)."""
        deadline = now + self._seconds[state]
        room.deadline_at = deadline
        self._queues[state][room.room_id] = room
        if deadline < self._timer_at:  # rare: only when this state's deadline is the shortest
            self._schedule(deadline)

    def disarm(self, room: Room, state: str) -> None:
        """Drop ``room``'s deadline for ``state`` (it left the state); the timer may stay early."""
        self._queues[state].pop(room.room_id, None)
        room.deadline_at = None

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def is_armed(self, room: Room) -> bool:
        """Whether ``room`` holds an armed deadline (in any state)."""
        return any(queue.get(room.room_id) is room for queue in self._queues.values())

    @property
    def next_wakeup_at(self) -> float | None:
        """Loop time the timer is set for, or None when no timer is pending."""
        return None if self._timer is None else self._timer_at

    def close(self) -> None:
        """Cancel the timer (queues should already be empty: the table failed every room)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, math.inf

    def _schedule(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._on_timer)
        self._timer_at = when

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, math.inf
        due_by = self._loop.time() + EXPIRY_SLACK_S
        for queue in self._queues.values():
            # Bounded by the queue length at wakeup: rooms that release callbacks open during
            # this pass wait for the next wakeup, even with deadlines shorter than the slack.
            for _ in range(len(queue)):
                if not queue:
                    break
                room = next(iter(queue.values()))
                if room.deadline_at > due_by:
                    break
                del queue[room.room_id]
                self._on_expired(room)
        self._reschedule()

    def _reschedule(self) -> None:
        heads = [next(iter(q.values())).deadline_at for q in self._queues.values() if q]
        if heads and min(heads) < self._timer_at:
            self._schedule(min(heads))
