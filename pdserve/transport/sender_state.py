"""The state a :class:`~pdserve.transport.sender.KVSender` shares with its parts.

The sender owns it; its write path (:mod:`pdserve.transport.writer`) and its decode peers
(:mod:`pdserve.transport.registrar`) are handed this object and one or two callbacks, never
the sender itself, so each part reads on its own and none imports the sender.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pdserve.fsm import Room, RoomTable
from pdserve.kernels.kv_cache import KVPagePool
from pdserve.transport.config import TransportConfig
from pdserve.transport.faults import FaultInjector
from pdserve.transport.liveness import DecodePeerManager
from pdserve.transport.messages import KVLayoutMsg
from pdserve.transport.nixl_agent import KVAgent
from pdserve.transport.stats import SenderStats

WriteKey = tuple[str | None, int]  # (decode peer key, the room's nonce)


@dataclass(slots=True)
class SenderState:
    """One sender's rooms, peers, counters and tasks. All of it is touched on the loop only."""

    config: TransportConfig
    pool: KVPagePool
    table: RoomTable
    peers: DecodePeerManager
    faults: FaultInjector | None
    layout: KVLayoutMsg
    counters: SenderStats = field(default_factory=SenderStats)
    writes: dict[WriteKey, Room] = field(default_factory=dict)  # rooms whose window is open
    started_agent: KVAgent | None = None  # set by KVSender.start()
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    @property
    def agent(self) -> KVAgent:
        """The NIXL agent (after the sender started)."""
        if self.started_agent is None:
            raise RuntimeError("KVSender.start() was not called")
        return self.started_agent

    def spawn(self, coro: Any, name: str) -> None:
        """Run ``coro`` as a task the sender waits for (bounded) when it stops."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def fire(self, room: Room, trigger: str) -> bool:
        # By object, not id: a new room may reuse the id of one that ended meanwhile.
        return self.table.get(room.room_id) is room and self.table.fire(room.room_id, trigger)

    def fail_if_live(self, room: Room, reason: str) -> None:
        if self.table.get(room.room_id) is room:
            self.table.fail(room.room_id, reason)
