"""One KV room: a request's KV hand-off between one prefill sender and one decode receiver.

A :class:`Room` is a plain slotted object. Its ``state`` field is written only by the shared
``transitions`` machine of its :class:`~pdserve.fsm.table.RoomTable` (never assigned by our code),
and everything else about its life (timers, release, the ``done`` future) is driven by the table.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class RoomState(StrEnum):
    """Room states; values are the names, which are also the ``transitions`` state names."""

    BOOTSTRAPPING = "Bootstrapping"
    WAITING_FOR_INPUT = "WaitingForInput"
    TRANSFERRING = "Transferring"
    SUCCESS = "Success"
    FAILED = "Failed"


class RoomSide(StrEnum):
    """Which end of the hand-off keeps the room."""

    SENDER = "sender"
    RECEIVER = "receiver"


TERMINAL_STATES: frozenset[str] = frozenset({RoomState.SUCCESS.value, RoomState.FAILED.value})


@dataclass(frozen=True)
class RoomDeadlines:
    """Per-state deadlines in seconds: every non-terminal state has one, so no room lives on."""

    bootstrapping_s: float = 30.0
    waiting_for_input_s: float = 60.0
    transferring_s: float = 30.0

    def __post_init__(self) -> None:
        for name, value in self.by_state().items():
            if not value > 0:
                raise ValueError(f"deadline for {name} must be > 0 s, got {value!r}")

    def by_state(self) -> dict[str, float]:
        """Deadline seconds keyed by the (non-terminal) state name."""
        return {
            RoomState.BOOTSTRAPPING.value: self.bootstrapping_s,
            RoomState.WAITING_FOR_INPUT.value: self.waiting_for_input_s,
            RoomState.TRANSFERRING.value: self.transferring_s,
        }


@dataclass(frozen=True)
class RoomOutcome:
    """How a room ended; the result of ``Room.done``."""

    room_id: str
    state: RoomState
    reason: str | None


class Room:
    """State of one room on one side. Owned and mutated only by its table, on the event loop.

    ``data`` is a free slot for the transport (destination pages, first token, ...). ``page_ids``
    are the local KV pages this room holds; the table's owner frees them in ``on_release``.
    Waiters should ``await asyncio.wait_for(asyncio.shield(room.done), t)``: a bare ``wait_for``
    cancels ``done`` on timeout and other waiters would then never see the outcome.
    """

    __slots__ = (
        "room_id",
        "side",
        "state",
        "request_id",
        "peer",
        "page_ids",
        "data",
        "reason",
        "created_at",
        "state_entered_at",
        "deadline_at",
        "finished_at",
        "last_transition",
        "num_chunks",
        "done",
    )

    def __init__(
        self,
        room_id: str,
        side: RoomSide,
        done: asyncio.Future[RoomOutcome],
        now: float,
        *,
        request_id: str | None = None,
        peer: str | None = None,
        page_ids: list[int] | None = None,
    ) -> None:
        # ``state`` is deliberately not assigned here: the table's machine sets the initial state.
        self.room_id = room_id
        self.side = side
        self.request_id = request_id
        self.peer = peer
        self.page_ids: list[int] = page_ids if page_ids is not None else []
        self.data: dict[str, Any] = {}
        self.reason: str | None = None
        self.created_at = now
        self.state_entered_at = now
        self.deadline_at: float | None = None
        self.finished_at: float | None = None
        self.last_transition: tuple[str, str, str, str | None] | None = None
        self.num_chunks = 0  # chunk_sent triggers accepted while Transferring
        self.done = done

    @property
    def is_terminal(self) -> bool:
        """True once the room reached Success or Failed (it never leaves them)."""
        return self.state in TERMINAL_STATES

    def age_s(self, now: float) -> float:
        """Seconds since creation (frozen at the finish time once terminal)."""
        end = self.finished_at if self.finished_at is not None else now
        return end - self.created_at

    def debug_dict(self) -> dict[str, Any]:
        """JSON-able snapshot for debug endpoints and logs."""
        now = self.done.get_loop().time()  # the table's clock (monotonic loop time)
        deadline_in = None if self.deadline_at is None else round(self.deadline_at - now, 6)
        last = None if self.last_transition is None else list(self.last_transition)
        return {
            "id": self.room_id,
            "side": self.side.value,
            "state": self.state,
            "request_id": self.request_id,
            "peer": self.peer,
            "age_s": round(self.age_s(now), 6),
            "deadline_in_s": deadline_in,
            "last_transition": last,
            "reason": self.reason,
            "num_pages": len(self.page_ids),
            "num_chunks": self.num_chunks,
        }

    def __repr__(self) -> str:
        state = getattr(self, "state", None)
        return f"Room({self.room_id!r}, {self.side.value}, {state}, req={self.request_id!r})"
