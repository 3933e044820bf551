"""KV room state machines: one request's KV hand-off from a prefill sender to a decode receiver."""

from __future__ import annotations

from pdserve.fsm.machine import (
    BEGIN_TRANSFER,
    BOOTSTRAPPED,
    CHUNK_SENT,
    FAIL,
    TRANSFER_DONE,
    TRIGGERS,
    build_room_machine,
)
from pdserve.fsm.room import (
    TERMINAL_STATES,
    Room,
    RoomDeadlines,
    RoomOutcome,
    RoomSide,
    RoomState,
)
from pdserve.fsm.stats import GONE, RoomStats, reason_key
from pdserve.fsm.table import DuplicateRoomError, RoomTable

__all__ = [
    "BEGIN_TRANSFER",
    "BOOTSTRAPPED",
    "CHUNK_SENT",
    "FAIL",
    "GONE",
    "TERMINAL_STATES",
    "TRANSFER_DONE",
    "TRIGGERS",
    "DuplicateRoomError",
    "Room",
    "RoomDeadlines",
    "RoomOutcome",
    "RoomSide",
    "RoomState",
    "RoomStats",
    "RoomTable",
    "build_room_machine",
    "reason_key",
]
