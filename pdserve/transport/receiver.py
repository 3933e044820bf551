"""KVReceiver: the decode side of KV rooms (registration, dst pages, notifications, the fence).

The decode engine lends destination pages to a room (:meth:`KVReceiver.open_room`); the room
registers with the prefill's bootstrap server if needed, posts the pages, then waits for the
sender's WRITEs. The data-is-there signal is the ``DataNotifMsg`` attached to each WRITE; the
room succeeds on the last chunk after its room id, nonce, sender incarnation and (if enabled)
checksum were checked. On Success the pages belong to the engine; nothing is called back.

The fence rule: destination pages of a *failed* room are handed back (``on_release``) only when
no write into them can still land: the POST never reached the sender, or the sender confirmed
that no write for the room is outstanding (abort ack), or the sender was declared dead and
``abort_quarantine_s`` elapsed. Until then they sit in the :class:`FenceManager`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.fsm import (
    BEGIN_TRANSFER,
    BOOTSTRAPPED,
    CHUNK_SENT,
    TRANSFER_DONE,
    Room,
    RoomSide,
    RoomState,
    RoomTable,
)
from pdserve.kernels.kv_cache import KVPagePool
from pdserve.transport.bootstrap import (
    BootstrapClient,
    BootstrapError,
    PeerIOError,
    PeerRejectedError,
    PeerUnreachableError,
)
from pdserve.transport.config import TransportConfig
from pdserve.transport.faults import maybe_injector
from pdserve.transport.liveness import BootstrapFailed, PrefillLink, PrefillLinkManager
from pdserve.transport.messages import (
    AbortMsg,
    AbortNotifMsg,
    DataNotifMsg,
    MessageError,
    PoolDescMsg,
    RegisterMsg,
    RoomMsg,
    decode_notif,
    page_checksum_off_loop,
)
from pdserve.transport.nixl_agent import KVAgent

logger = logging.getLogger(__name__)

_BOOTSTRAPPING = RoomState.BOOTSTRAPPING.value
_WAITING = RoomState.WAITING_FOR_INPUT.value
_SUCCESS = RoomState.SUCCESS.value
MAX_POST_ATTEMPTS = 3  # re-register and re-post when the prefill forgot us in between

ReleaseFn = Callable[[str, list[int]], None]


@dataclass(slots=True)
class ReceiverStats:
    """Plain counters of one receiver (read at scrape time)."""

    rooms_opened: int = 0
    rooms_received: int = 0
    bytes_received: int = 0
    chunks_received: int = 0
    aborts_received: int = 0  # AbortNotifMsg from the sender
    stale_rejected: int = 0  # notifications from another sender incarnation than the room's
    late_notifs: int = 0  # notifications for rooms that already ended (or another nonce)
    bad_notifs: int = 0
    notifs_dropped: int = 0  # fault injection
    checksum_failures: int = 0
    bootstrap_errors: int = 0
    peers_lost: int = 0
    released_immediately: int = 0  # failed rooms whose pages the sender never had


# -- the fence ----------------------------------------------------------------------------------


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


# -- the receiver --------------------------------------------------------------------------------


class KVReceiver:
    """Decode side of the KV transport. All methods run on the event loop."""

    def __init__(self, config: TransportConfig, pool: KVPagePool, on_release: ReleaseFn) -> None:
        self.config = config
        self.pool = pool
        self.table = RoomTable(
            RoomSide.RECEIVER, config.deadlines, on_release=self._on_room_release
        )
        self._on_release = on_release
        self._faults = maybe_injector(config.faults)
        self._client = BootstrapClient(config.connect_timeout_s, config.request_timeout_s)
        self._counters = ReceiverStats()
        self._nonces = itertools.count(1)
        self._agent: KVAgent | None = None
        self._links: PrefillLinkManager | None = None
        self._fence: FenceManager | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the NIXL agent, the HTTP client, heartbeats and the fence."""
        loop = asyncio.get_running_loop()
        self._agent = KVAgent(self.config.peer_key, self.pool, loop, self._on_notif)
        self._agent.start()
        await self._client.start()
        cfg, agent = self.config, self._agent
        register = RegisterMsg(
            cfg.engine_id,
            cfg.incarnation,
            agent.name,
            agent.metadata,
            PoolDescMsg.from_dict(agent.descriptor.to_json()),
        )
        self._links = PrefillLinkManager(cfg, self._client, register, self._on_link_lost)
        self._fence = FenceManager(cfg, self._client, self._on_fence_lifted)
        self._fence.start()
        logger.info("receiver %s started", cfg.peer_key)

    async def stop(self) -> None:
        """Fail live rooms (shutdown), stop heartbeats, close the agent."""
        self.table.close("shutdown")
        if self._tasks:  # first asks for the acks of the rooms just failed: bounded wait
            await asyncio.wait(set(self._tasks), timeout=self.config.request_timeout_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._links is not None:
            await self._links.close()
        if self._fence is not None:
            await self._fence.close(grace_s=self.config.request_timeout_s)
        await self._client.close()
        if self._agent is not None:
            await self._agent.close()
        logger.info("receiver %s stopped", self.config.peer_key)

    @property
    def agent(self) -> KVAgent:
        """The NIXL agent (after start())."""
        if self._agent is None:
            raise RuntimeError("KVReceiver.start() was not called")
        return self._agent

    # -- engine API ----------------------------------------------------------------------------

    async def open_room(
        self,
        room_id: str,
        request_id: str,
        bootstrap_host: str,
        bootstrap_port: int,
        dst_page_ids: list[int],
        num_tokens: int,
        num_cached_pages: int = 0,
    ) -> Room:
        """Lend ``dst_page_ids`` to a room and start its hand-shake; await ``room.done``.

        ``num_cached_pages``: leading prompt pages this side already holds (not lent; the
        sender writes only the pages after them).

        Raises DuplicateRoomError (live id) or ValueError (bad pages) before any room exists;
        every later failure ends the room (``bootstrap_error: ...``, ``peer_lost``, ...).
        """
        self._check_pages(dst_page_ids, num_tokens)
        agent = self.agent
        room = self.table.create(room_id, request_id=request_id, page_ids=list(dst_page_ids))
        room.data.update(
            nonce=next(self._nonces),
            host=bootstrap_host,
            port=bootstrap_port,
            num_tokens=num_tokens,
            num_cached_pages=num_cached_pages,
            posted="no",  # "no" | "maybe" | "yes": could the sender know our pages?
            next_chunk=0,
        )
        self._counters.rooms_opened += 1
        # Writes into our pages need our agent's polling to progress: warm until the room
        # ends, or, when it ends fenced (a write may still land), until the fence lifts.
        agent.hold_warm()
        self._spawn(self._bootstrap(room), f"kv-boot-{room_id}")
        return room

    def abort(self, room_id: str, reason: str = "aborted") -> bool:
        """Fail a live room and tell the prefill side. False if the room already ended."""
        return self.table.abort(room_id, reason)

    @property
    def stats(self) -> dict[str, int | float]:
        """Counters of this receiver, its fence, its faults and its live rooms."""
        out: dict[str, int | float] = asdict(self._counters)
        if self._fence is not None:
            out.update(asdict(self._fence.stats))
            out["num_fenced"] = self._fence.num_fenced
            out["num_fenced_pages"] = self._fence.num_fenced_pages
        out["num_live_rooms"] = len(self.table)
        if self._links is not None:
            out["register_retries"] = self._links.num_register_retries
            out["num_links"] = len(self._links.links())
        if self._faults is not None:
            out.update({f"fault_{k}": v for k, v in asdict(self._faults.stats).items()})
        return out

    def debug_peers(self) -> list[dict[str, Any]]:
        """Prefill links with their live room counts."""
        if self._links is None:
            return []
        now = asyncio.get_running_loop().time()
        peers = [r.peer for r in self.table.rooms()]
        return [
            {**ln.debug_dict(now), "num_rooms": peers.count(ln.key)} for ln in self._links.links()
        ]

    # -- hand-shake ----------------------------------------------------------------------------

    async def _bootstrap(self, room: Room) -> None:
        assert self._links is not None
        host, port = room.data["host"], room.data["port"]
        for attempt in range(MAX_POST_ATTEMPTS):
            try:
                link = await self._links.connect(host, port, room.deadline_at or 0.0)
            except BootstrapFailed as e:
                self._counters.bootstrap_errors += 1
                self._fail(room, str(e))
                return
            if not self._is_live(room):
                return  # ended while registering: the sender never saw our pages
            room.data.update(sender_key=link.key, sender_agent=link.agent_name)
            room.data["sender_incarnation"] = link.incarnation
            if await self._post_room(room, link, is_last_try=attempt == MAX_POST_ATTEMPTS - 1):
                return

    async def _post_room(self, room: Room, link: PrefillLink, is_last_try: bool) -> bool:
        """POST the pages; True when done (either way), False to re-register and retry."""
        assert self._links is not None
        cfg = self.config
        msg = RoomMsg(
            cfg.engine_id,
            cfg.incarnation,
            room.data["nonce"],
            room.page_ids,
            room.data["num_tokens"],
            room.data["num_cached_pages"],
        )
        room.data["posted"] = "maybe"
        try:
            await self._client.post_room(link.host, link.port, room.room_id, msg)
        except PeerRejectedError as e:
            room.data["posted"] = "no"
            if e.status == 404 and not is_last_try:  # it forgot us: register again
                room.data.pop("sender_key", None)  # this room is retried, not failed with the link
                self._links.lose(
                    link, f"peer_lost: prefill no longer knows this decode ({e})", False
                )
                return False
            if e.status == 410:  # the prefill ended this room before our pages got there
                room.data["peer_aborted"] = True
                self._fail(room, f"aborted: by prefill ({e.message})")
            else:
                self._fail(room, f"bootstrap_error: {e}")
            return True
        except (PeerUnreachableError, PeerIOError) as e:
            if isinstance(e, PeerUnreachableError):
                room.data["posted"] = "no"
            self._counters.bootstrap_errors += 1
            self._fail(room, f"bootstrap_error: posting pages: {e}")
            return True
        room.data["posted"] = "yes"
        if not self._is_live(room):
            return True  # failed meanwhile: its fence entry already asks the sender
        if self._links.get(link.host, link.port) is not link:
            self._fail(room, "peer_lost: prefill link lost while posting pages")
            return True
        self.table.bind_peer(room.room_id, link.key)
        if room.state == _BOOTSTRAPPING:  # data may have overtaken this HTTP answer
            self.table.fire(room.room_id, BOOTSTRAPPED)
        return True

    # -- notifications (from the NIXL agent thread, delivered on the loop) ---------------------

    def _on_notif(self, agent_name: str, payload: bytes) -> None:
        try:
            msg = decode_notif(payload)
        except MessageError as e:
            self._counters.bad_notifs += 1
            logger.warning("bad notification from %s: %s", agent_name, e)
            return
        room = self.table.get(msg.room_id)
        if room is None or room.data.get("nonce") != msg.nonce:
            self._on_notif_for_gone_room(msg)
            return
        if agent_name != room.data.get("sender_agent") or msg.incarnation != room.data.get(
            "sender_incarnation"
        ):
            self._counters.stale_rejected += 1
            logger.warning(
                "room=%s notification from %s (incarnation %s) rejected: room is with %s",
                msg.room_id,
                agent_name,
                msg.incarnation,
                room.data.get("sender_agent"),
            )
            return
        if isinstance(msg, AbortNotifMsg):
            self._counters.aborts_received += 1
            room.data.update(peer_aborted=True, sender_fenced=msg.is_fenced)
            self.table.fail(room.room_id, f"aborted: by prefill ({msg.reason})")
        else:
            self._on_data(room, msg)

    def _on_notif_for_gone_room(self, msg: DataNotifMsg | AbortNotifMsg) -> None:
        if isinstance(msg, AbortNotifMsg) and msg.is_fenced and self._fence is not None:
            self._fence.on_ack(msg.nonce)
            return
        self._counters.late_notifs += 1
        logger.debug(
            "room=%s nonce=%d: late %s notification ignored",
            msg.room_id,
            msg.nonce,
            type(msg).__name__,
        )

    def _on_data(self, room: Room, msg: DataNotifMsg) -> None:
        if self._faults is not None and self._faults.should_drop_notif():
            self._counters.notifs_dropped += 1
            return
        if msg.chunk != room.data["next_chunk"]:
            self._fail(
                room, f"transfer_error: chunk {msg.chunk}, expected {room.data['next_chunk']}"
            )
            return
        room.data["next_chunk"] += 1
        self._counters.chunks_received += 1
        if room.state == _BOOTSTRAPPING:
            self.table.fire(room.room_id, BOOTSTRAPPED)
        if room.state == _WAITING:
            self.table.fire(room.room_id, BEGIN_TRANSFER)
        if not msg.is_last:
            self.table.fire(room.room_id, CHUNK_SENT)
            return
        if msg.num_pages > len(room.page_ids):
            self._fail(
                room, f"transfer_error: {msg.num_pages} pages written, {len(room.page_ids)} lent"
            )
            return
        room.data.update(
            first_token=msg.first_token,
            first_logprob=msg.first_logprob,
            first_top_logprobs=msg.first_top_logprobs,
            num_pages=msg.num_pages,
        )
        if self.config.checksum:
            self._spawn(self._verify_then_finish(room, msg), f"kv-verify-{room.room_id}")
        else:
            self._finish(room)

    async def _verify_then_finish(self, room: Room, msg: DataNotifMsg) -> None:
        if msg.checksum is None:
            self._fail(room, "transfer_error: checksum missing (sender has checksum off)")
            return
        pages = room.page_ids[: msg.num_pages]
        checksum = await page_checksum_off_loop(self.pool.kv, pages)
        if not self._is_live(room):
            return
        if checksum != msg.checksum:
            self._counters.checksum_failures += 1
            self._fail(room, "transfer_error: checksum mismatch")
            return
        self._finish(room)

    def _finish(self, room: Room) -> None:
        if not self.table.fire(room.room_id, TRANSFER_DONE):
            return
        self._counters.rooms_received += 1
        self._counters.bytes_received += room.data["num_pages"] * self.pool.page_bytes
        key = room.data["sender_key"]
        if self._faults is not None and self._faults.should_drop_peer(key) and self._links:
            link = self._links.get(room.data["host"], room.data["port"])
            if link is not None and link.key == key:
                self._links.lose(link, "peer_lost: fault injection", False)

    # -- failure, release, fence ---------------------------------------------------------------

    def _fail(self, room: Room, reason: str, sender_dead: bool = False) -> None:
        if self._is_live(room):
            room.data["sender_dead"] = sender_dead
            self.table.fail(room.room_id, reason)

    def _on_link_lost(self, link: PrefillLink, reason: str, is_dead: bool) -> None:
        self._counters.peers_lost += 1
        for room in self.table.rooms():
            if room.data.get("sender_key") == link.key:
                room.data["sender_dead"] = is_dead
                self.table.bind_peer(room.room_id, link.key)  # includes rooms mid-POST
        self.table.fail_peer(link.key, reason)
        if is_dead and self._fence is not None:
            self._fence.on_sender_dead(link.key)

    def _on_room_release(self, room: Room) -> None:
        """Table callback. Success: the engine keeps the pages. Failed: release or fence."""
        if room.state == _SUCCESS:
            self._release_warm()
            return
        data = room.data
        if data.get("posted", "no") == "no" or data.get("sender_fenced"):
            self._release_warm()
            self._counters.released_immediately += 1
            self._release_pages(room.room_id, room.page_ids)
            if data.get("posted", "no") == "no" and (room.reason or "").startswith("aborted"):
                self._spawn(self._tell_unposted_abort(room), f"kv-abort-{room.room_id}")
            return
        assert self._fence is not None
        entry = FenceEntry(
            room.room_id,
            data["nonce"],
            room.page_ids,
            data["host"],
            data["port"],
            data["sender_key"],
            data["sender_incarnation"],
            room.reason or "aborted",
            asyncio.get_running_loop().time(),
        )
        self._fence.add(
            entry, ask=not data.get("peer_aborted"), is_sender_dead=bool(data.get("sender_dead"))
        )

    async def _tell_unposted_abort(self, room: Room) -> None:
        """Best effort: the prefill may have the room open, waiting for pages that never come."""
        if room.data.get("peer_aborted"):
            return
        cfg = self.config
        msg = AbortMsg(cfg.engine_id, cfg.incarnation, room.data["nonce"], room.reason or "aborted")
        try:
            await self._client.abort(room.data["host"], room.data["port"], room.room_id, msg)
        except BootstrapError as e:  # nothing of ours is at stake: its deadline ends that room
            logger.debug("room=%s abort before bootstrap not delivered: %s", room.room_id, e)

    def _on_fence_lifted(self, entry: FenceEntry, how: str) -> None:
        self._release_warm()  # the hold its room passed on
        self._release_pages(entry.room_id, entry.page_ids)

    def _release_warm(self) -> None:
        if self._agent is not None:
            self._agent.release_warm()

    def _release_pages(self, room_id: str, page_ids: list[int]) -> None:
        try:
            self._on_release(room_id, page_ids)
        except Exception:
            logger.exception("room=%s on_release failed", room_id)

    # -- helpers -------------------------------------------------------------------------------

    def _is_live(self, room: Room) -> bool:
        return self.table.get(room.room_id) is room

    def _check_pages(self, page_ids: list[int], num_tokens: int) -> None:
        num_pages = self.pool.config.num_pages
        if not page_ids or len(page_ids) > self.config.max_room_pages:
            raise ValueError(
                f"a room needs 1..{self.config.max_room_pages} pages, got {len(page_ids)}"
            )
        if min(page_ids) < 0 or max(page_ids) >= num_pages or len(set(page_ids)) != len(page_ids):
            raise ValueError(f"dst pages must be distinct ids in [0, {num_pages})")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
