"""RoomTable: the live rooms of one side, their deadlines, and their release.

Single writer: every method runs on the table's event loop (threads hand results over with
``loop.call_soon_threadsafe``). All rooms share one model-less ``transitions`` machine; the table
screens each trigger against the room's state first, so an invalid or late trigger (after an
abort, say) is a counted no-op that never raises and never changes an outcome.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from transitions import Machine

from pdserve.fsm.deadlines import DeadlineQueues
from pdserve.fsm.machine import CHUNK_SENT, FAIL, TRIGGERS, build_room_machine
from pdserve.fsm.machine import valid_triggers_by_state as _valid_triggers
from pdserve.fsm.room import TERMINAL_STATES, Room, RoomDeadlines, RoomOutcome, RoomSide, RoomState
from pdserve.fsm.stats import GONE, RoomStats, reason_key

logger = logging.getLogger(__name__)

MAX_RECENT = 256  # finished rooms kept for debug()
UNKNOWN_TRIGGER = "<unknown>"  # rejected trigger names outside TRIGGERS share one stats key
_SUCCESS = RoomState.SUCCESS.value
_STATE_BY_VALUE = {s.value: s for s in RoomState}
_LIVE_STATES = tuple(s.value for s in RoomState if s.value not in TERMINAL_STATES)
_TRANSITION_LOG = "room=%s req=%s side=%s %s -> %s trigger=%s reason=%s"
_DEBUG = logging.DEBUG


class DuplicateRoomError(ValueError):
    """A live room already has this id (ids may be reused once the earlier room finished)."""


class RoomTable:
    """Live rooms of one side (sender or receiver), keyed by room id."""

    def __init__(
        self,
        side: RoomSide,
        deadlines: RoomDeadlines = RoomDeadlines(),
        on_release: Callable[[Room], None] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        lean_machine: bool = True,
    ) -> None:
        """``lean_machine=False`` uses the stock ``transitions.Machine`` (for comparison)."""
        self.side = side
        self._side = side.value  # plain str for log lines (Enum.value is a descriptor call)
        self.deadlines = deadlines
        self.stats = RoomStats()
        self._on_release = on_release
        self._loop = loop  # bound to the running loop at the first create() when not given
        self._machine = build_room_machine(side, lean=lean_machine)
        self._initial = self._machine.get_state(self._machine.initial)
        self._triggers = {name: event.trigger for name, event in self._machine.events.items()}
        self._valid = _valid_triggers(self._machine)
        self._deadlines = DeadlineQueues(deadlines, self._on_deadline)
        if loop is not None:
            self._deadlines.bind(loop)
        self._rooms: dict[str, Room] = {}
        self._recent: deque[Room] = deque(maxlen=MAX_RECENT)

    @property
    def machine(self) -> Machine:
        """The shared, model-less machine of this table's rooms (introspection and tests)."""
        return self._machine

    @property
    def deadline_queues(self) -> DeadlineQueues:
        """Armed deadlines of the live rooms (introspection and tests)."""
        return self._deadlines

    # -- lifecycle -------------------------------------------------------------------------

    def create(
        self,
        room_id: str,
        *,
        request_id: str | None = None,
        peer: str | None = None,
        page_ids: list[int] | None = None,
    ) -> Room:
        """Open a room in Bootstrapping with its deadline armed. Raises DuplicateRoomError."""
        if room_id in self._rooms:
            raise DuplicateRoomError(f"room {room_id!r} is already live on the {self._side}")
        loop = self._loop if self._loop is not None else self._bind_loop()
        now = loop.time()
        room = Room(
            room_id,
            self.side,
            loop.create_future(),
            now,
            request_id=request_id,
            peer=peer,
            page_ids=page_ids,
        )
        self._machine.set_state(self._initial, room)
        self._rooms[room_id] = room
        self.stats.created += 1
        self._deadlines.arm(room, room.state, now)
        logger.debug(
            "room=%s req=%s side=%s created -> %s peer=%s",
            room_id,
            request_id,
            self._side,
            room.state,
            peer,
        )
        return room

    def fire(self, room_id: str, trigger: str, reason: str | None = None) -> bool:
        """Apply ``trigger`` to a live room; False (counted, logged) when invalid or room gone."""
        room = self._rooms.get(room_id)
        if room is None:
            return self._reject(room_id, trigger, GONE)
        source = room.state
        if trigger not in self._valid[source]:
            return self._reject(room_id, trigger, source)
        if trigger == FAIL and not reason:
            logger.warning("room=%s fail without a reason; recording 'unspecified'", room_id)
            reason = "unspecified"
        if not self._triggers[trigger](room):  # no conditions exist, so this is a bug guard
            return self._reject(room_id, trigger, source)
        self.stats.transitions += 1
        dest = room.state
        room.last_transition = (trigger, source, dest, reason)
        if trigger == CHUNK_SENT:  # internal: same state, deadline keeps running
            room.num_chunks += 1
            if logger.isEnabledFor(_DEBUG):  # skip the call when off: this runs per chunk
                self._log_transition(_DEBUG, room, trigger, source, reason)
            return True
        self._deadlines.disarm(room, source)
        now = self._loop.time()
        room.state_entered_at = now
        if dest in TERMINAL_STATES:
            self._finish(room, trigger, source, reason, now)
        else:
            self._deadlines.arm(room, dest, now)
            if logger.isEnabledFor(_DEBUG):
                self._log_transition(_DEBUG, room, trigger, source, reason)
        return True

    def fire_room(self, room: Room, trigger: str, reason: str | None = None) -> bool:
        """``fire`` on this exact room object: a counted no-op (``Gone``) once it finished, even
        if a newer room reuses its id. Use it from workers that hold a room across awaits."""
        if self._rooms.get(room.room_id) is not room:
            return self._reject(room.room_id, trigger, GONE)
        return self.fire(room.room_id, trigger, reason)

    def fail(self, room_id: str, reason: str) -> bool:
        """Fail a live room (aborted, peer_lost, transfer_error: ..., ...). False if not live."""
        return self.fire(room_id, FAIL, reason)

    def abort(self, room_id: str, reason: str = "aborted") -> bool:
        """Fail a live room as aborted (reason kept under an ``aborted`` prefix, so metrics group
        every abort). False, and nothing counted, when the room is not live."""
        if room_id not in self._rooms:
            return False
        return self.fail(room_id, reason if reason.startswith("aborted") else f"aborted: {reason}")

    def fail_peer(self, peer: str, reason: str) -> list[str]:
        """Fail every live room bound to ``peer``; returns the ids that were failed."""
        ids = [room.room_id for room in self._rooms.values() if room.peer == peer]
        failed = [room_id for room_id in ids if self.fail(room_id, reason)]
        if failed:
            logger.info(
                "side=%s peer=%s failed %d rooms reason=%s",
                self._side,
                peer,
                len(failed),
                reason,
            )
        return failed

    def expire(self, room_id: str) -> bool:
        """Expire the room's current-state deadline now: what the deadline timer calls."""
        room = self._rooms.get(room_id)
        if room is None:
            return self._reject(room_id, FAIL, GONE)
        state = room.state
        if not self.fire(room_id, FAIL, f"timeout:{state}"):
            return False
        counts = self.stats.timeouts_by_state
        counts[state] = counts.get(state, 0) + 1
        return True

    def bind_peer(self, room_id: str, peer: str) -> None:
        """Record the peer engine of a live room (for fail_peer); ignored for a gone room."""
        room = self._rooms.get(room_id)
        if room is None:
            logger.debug("room=%s bind_peer(%s) on a gone room: ignored", room_id, peer)
            return
        if room.peer is not None and room.peer != peer:
            logger.info("room=%s peer %s -> %s", room_id, room.peer, peer)
        room.peer = peer

    def close(self, reason: str = "shutdown") -> None:
        """Fail (and so release) every live room with ``reason``; cancel the deadline timer."""
        num_live = len(self._rooms)
        for room_id in list(self._rooms):
            self.fail(room_id, reason)
        self._deadlines.close()
        if num_live:
            logger.info("side=%s closed: failed %d live rooms (%s)", self._side, num_live, reason)

    # -- queries ---------------------------------------------------------------------------

    def get(self, room_id: str) -> Room | None:
        """The live room with this id, or None (finished rooms are gone)."""
        return self._rooms.get(room_id)

    def rooms(self) -> list[Room]:
        """Live rooms, oldest first."""
        return list(self._rooms.values())

    def __len__(self) -> int:
        return len(self._rooms)

    def __contains__(self, room_id: object) -> bool:
        return room_id in self._rooms

    def count_by_state(self) -> dict[str, int]:
        """Live rooms per non-terminal state (every state present, 0 when none)."""
        counts = dict.fromkeys(_LIVE_STATES, 0)
        for room in self._rooms.values():
            counts[room.state] += 1
        return counts

    def oldest_age_by_state(self, now: float | None = None) -> dict[str, float]:
        """Largest ``Room.age_s`` (since creation) per non-terminal state; 0.0 when none."""
        oldest = dict.fromkeys(_LIVE_STATES, 0.0)
        if not self._rooms:
            return oldest
        if now is None:
            now = self._loop.time()
        for room in self._rooms.values():
            age = now - room.created_at
            if age > oldest[room.state]:
                oldest[room.state] = age
        return oldest

    def debug(self) -> list[dict[str, Any]]:
        """``Room.debug_dict`` of every live room."""
        return [room.debug_dict() for room in self._rooms.values()]

    def recent(self) -> list[dict[str, Any]]:
        """``Room.debug_dict`` of the last finished rooms (up to MAX_RECENT), oldest first."""
        return [room.debug_dict() for room in self._recent]

    # -- internals -------------------------------------------------------------------------

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        self._loop = asyncio.get_running_loop()
        self._deadlines.bind(self._loop)
        return self._loop

    def _on_deadline(self, room: Room) -> None:
        # The queues only hold live rooms in the state they were armed for; stay defensive.
        if self._rooms.get(room.room_id) is room:
            self.expire(room.room_id)

    def _finish(
        self, room: Room, trigger: str, source: str, reason: str | None, now: float
    ) -> None:
        del self._rooms[room.room_id]
        room.finished_at = now
        dest = room.state
        if dest == _SUCCESS:
            self.stats.succeeded += 1
            self._log_transition(_DEBUG, room, trigger, source, reason)
        else:
            room.reason = reason
            self.stats.failed += 1
            by_reason = self.stats.failed_by_reason
            key = reason_key(reason or "")
            by_reason[key] = by_reason.get(key, 0) + 1
            self._log_transition(logging.INFO, room, trigger, source, reason)
        self._recent.append(room)
        self._release(room)
        if not room.done.done():  # a waiter may have cancelled it (bare wait_for timeout)
            room.done.set_result(RoomOutcome(room.room_id, _STATE_BY_VALUE[dest], room.reason))

    def _release(self, room: Room) -> None:
        if self._on_release is None:
            return
        try:
            self._on_release(room)
        except Exception:
            self.stats.release_errors += 1
            logger.exception("room=%s req=%s on_release failed", room.room_id, room.request_id)

    def _reject(self, room_id: str, trigger: str, state: str) -> bool:
        key = (trigger if trigger in TRIGGERS else UNKNOWN_TRIGGER, state)
        rejected = self.stats.rejected
        rejected[key] = rejected.get(key, 0) + 1
        logger.debug(
            "room=%s side=%s trigger=%s rejected in state=%s",
            room_id,
            self._side,
            trigger,
            state,
        )
        return False

    def _log_transition(
        self, level: int, room: Room, trigger: str, source: str, reason: str | None
    ) -> None:
        logger.log(
            level,
            _TRANSITION_LOG,
            room.room_id,
            room.request_id,
            self._side,
            source,
            room.state,
            trigger,
            reason,
        )
