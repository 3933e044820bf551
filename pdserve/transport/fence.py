"""The fence: destination pages of a failed room that a write may still reach.

A decode worker never reuses such pages while a write into them may still land. The
:class:`FenceManager` holds them until the sender acknowledges that no write for the room is
outstanding (asked with ``POST /abort``, retried every heartbeat interval), or until the sender
was declared dead and ``abort_quarantine_s`` elapsed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.fsm import Room
from pdserve.transport.bootstrap import (
    BootstrapClient,
    PeerIOError,
    PeerRejectedError,
    PeerUnreachableError,
)
from pdserve.transport.config import TransportConfig
from pdserve.transport.messages import AbortMsg

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class FenceEntry:
    """Destination pages of a failed room that a write may still reach."""

    room_id: str
    nonce: int
    page_ids: list[int]
    host: str
    port: int
    sender_key: str
    sender_incarnation: str
    reason: str
    since: float
    release_at: float | None = None  # set once quarantined (sender dead)
    last_asked: float = float("-inf")
    unreachable_since: float | None = None
    is_asking: bool = False
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    @classmethod
    def of_room(cls, room: Room, now: float) -> FenceEntry:
        """The entry of a failed receiver room whose pages the sender may have (posted)."""
        d = room.data
        return cls(
            room.room_id, d["nonce"], room.page_ids, d["host"], d["port"], d["sender_key"],
            d["sender_incarnation"], room.reason or "aborted", now,
        )  # fmt: skip


@dataclass(slots=True)
class FenceStats:
    acks_requested: int = 0  # POST /abort sent (first asks and retries)
    released_by_ack: int = 0
    released_by_quarantine: int = 0


class FenceManager:
    """Owns fenced pages until the sender acks or is dead + quarantined. Loop-only state."""

    def __init__(
        self,
        config: TransportConfig,
        client: BootstrapClient,
        release: Callable[[FenceEntry, str], None],
    ) -> None:
        self.config = config
        self.client = client
        self.stats = FenceStats()
        self._release = release
        self._loop = asyncio.get_running_loop()
        self._entries: dict[int, FenceEntry] = {}  # by nonce
        self._tick: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Start the retry tick (asks again for acks that did not come)."""
        self._tick = self._loop.create_task(self._tick_loop(), name="kv-fence")

    async def close(self, grace_s: float) -> None:
        """Stop asking (after up to ``grace_s`` for asks in flight, so the sender hears of the
        aborts); pages still fenced stay unreleased: the process is going away."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
        tasks = [t for t in (self._tick, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for entry in self._entries.values():
            if entry.timer is not None:
                entry.timer.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._entries:
            logger.info("fence closed with %d rooms still fenced", len(self._entries))

    @property
    def num_fenced(self) -> int:
        """Failed rooms whose pages are still fenced."""
        return len(self._entries)

    @property
    def num_fenced_pages(self) -> int:
        """Destination pages still fenced."""
        return sum(len(e.page_ids) for e in self._entries.values())

    def add(self, entry: FenceEntry, ask: bool, is_sender_dead: bool) -> None:
        """Fence ``entry``; ask the sender for its ack now unless it already knows."""
        self._entries[entry.nonce] = entry
        logger.debug(
            "room=%s fenced (%d pages): %s", entry.room_id, len(entry.page_ids), entry.reason
        )
        if is_sender_dead:
            self._quarantine(entry)
        elif ask:
            self._ask(entry)

    def on_ack(self, nonce: int) -> None:
        """The sender confirmed no write for this room is outstanding."""
        entry = self._entries.get(nonce)
        if entry is not None:
            self._lift(entry, "ack")

    def on_sender_dead(self, sender_key: str) -> None:
        """Quarantine every entry of a sender that was declared dead."""
        for entry in list(self._entries.values()):
            if entry.sender_key == sender_key:
                self._quarantine(entry)

    def _quarantine(self, entry: FenceEntry) -> None:
        if entry.release_at is not None:
            return
        entry.release_at = self._loop.time() + self.config.abort_quarantine_s
        entry.timer = self._loop.call_at(entry.release_at, self._lift, entry, "quarantine")
        logger.info(
            "room=%s sender %s dead: pages quarantined for %.2fs",
            entry.room_id,
            entry.sender_key,
            self.config.abort_quarantine_s,
        )

    def _lift(self, entry: FenceEntry, how: str) -> None:
        if self._entries.get(entry.nonce) is not entry:
            return
        del self._entries[entry.nonce]
        if entry.timer is not None:
            entry.timer.cancel()
        if how == "ack":
            self.stats.released_by_ack += 1
        else:
            self.stats.released_by_quarantine += 1
        logger.debug("room=%s fence lifted by %s", entry.room_id, how)
        self._release(entry, how)

    def _ask(self, entry: FenceEntry) -> None:
        if entry.is_asking or entry.release_at is not None:
            return
        entry.is_asking = True
        entry.last_asked = self._loop.time()
        self.stats.acks_requested += 1
        task = self._loop.create_task(self._ask_once(entry), name=f"kv-fence-{entry.room_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _ask_once(self, entry: FenceEntry) -> None:
        cfg = self.config
        msg = AbortMsg(cfg.engine_id, cfg.incarnation, entry.nonce, entry.reason)
        try:
            reply = await self.client.abort(entry.host, entry.port, entry.room_id, msg)
        except (PeerUnreachableError, PeerIOError) as e:
            now = self._loop.time()
            if entry.unreachable_since is None:
                entry.unreachable_since = now
            if now - entry.unreachable_since >= cfg.peer_lost_after_s:
                logger.info("room=%s fence: sender unreachable (%s)", entry.room_id, e)
                self._quarantine(entry)
            return
        except PeerRejectedError as e:  # cannot get an ack from this sender: wait it out
            logger.info("room=%s fence: abort rejected (%s)", entry.room_id, e)
            self._quarantine(entry)
            return
        finally:
            entry.is_asking = False
        entry.unreachable_since = None
        if reply.incarnation != entry.sender_incarnation:
            self._quarantine(entry)  # that sender restarted: its old life is dead
        elif reply.is_acked:
            self._lift(entry, "ack")

    async def _tick_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)  # retry cadence for unanswered acks
            now = self._loop.time()
            for entry in list(self._entries.values()):
                if now - entry.last_asked >= interval:
                    self._ask(entry)
