"""Shared helpers for the room state machine tests."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import pytest

from pdserve.fsm import Room, RoomDeadlines, RoomOutcome, RoomSide, RoomTable

WAIT_S = 5.0  # upper bound on any await in these tests; real waits are milliseconds


class ManualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose time only moves when the test says so (deadline tests, no sleeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock, then run one pass of the loop: every timer now due fires."""
        self.now += seconds
        self.run_until_complete(asyncio.sleep(0))


class ReleaseLog:
    """on_release callback that records every call, so tests can prove exactly-once release."""

    def __init__(self) -> None:
        self.rooms: list[Room] = []
        self.counts: Counter[int] = Counter()  # keyed by id(room): ids may be reused by new rooms

    def __call__(self, room: Room) -> None:
        self.rooms.append(room)
        self.counts[id(room)] += 1

    def count(self, room: Room) -> int:
        return self.counts[id(room)]


@pytest.fixture
def release_log() -> ReleaseLog:
    return ReleaseLog()


@pytest.fixture
def make_table(release_log: ReleaseLog) -> Callable[..., RoomTable]:
    """Factory: a table on the running loop, releasing into ``release_log``."""

    def make(side: RoomSide = RoomSide.SENDER, **deadlines: float) -> RoomTable:
        return RoomTable(side, RoomDeadlines(**deadlines), on_release=release_log)

    return make


async def wait_done(room: Room, limit_s: float = WAIT_S) -> RoomOutcome:
    """Await a room's outcome with a timeout, without cancelling ``done`` for other waiters."""
    return await asyncio.wait_for(asyncio.shield(room.done), limit_s)
