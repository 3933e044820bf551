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
from dataclasses import asdict
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
)
from pdserve.transport.checksum import page_checksum_off_loop
from pdserve.transport.config import TransportConfig
from pdserve.transport.faults import maybe_injector
from pdserve.transport.fence import FenceEntry, FenceManager
from pdserve.transport.handshake import Handshake
from pdserve.transport.layout import layout_of
from pdserve.transport.liveness import PrefillLink, PrefillLinkManager
from pdserve.transport.messages import (
    AbortMsg,
    AbortNotifMsg,
    DataNotifMsg,
    PoolDescMsg,
    RegisterMsg,
    decode_notif,
)
from pdserve.transport.nixl_agent import KVAgent
from pdserve.transport.stats import ReceiverStats
from pdserve.transport.wire import MessageError

logger = logging.getLogger(__name__)

_BOOTSTRAPPING = RoomState.BOOTSTRAPPING.value
_WAITING = RoomState.WAITING_FOR_INPUT.value
_SUCCESS = RoomState.SUCCESS.value

ReleaseFn = Callable[[str, list[int]], None]


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
        self.client = BootstrapClient(
            config.connect_timeout_s, config.request_timeout_s, config.bootstrap_token,
            tls=config.tls,
        )  # fmt: skip
        self.counters = ReceiverStats()
        self.layout = layout_of(
            pool, config.model_name, config.model_fingerprint, config.weights_fingerprint
        )
        self._nonces = itertools.count(1)
        self._agent: KVAgent | None = None
        self.links: PrefillLinkManager | None = None
        self._fence: FenceManager | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._handshake: Handshake | None = None  # needs the links: made in start()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the NIXL agent, the HTTP client, heartbeats and the fence."""
        loop = asyncio.get_running_loop()
        self._agent = KVAgent(self.config.peer_key, self.pool, loop, self._on_notif)
        self._agent.start()
        await self.client.start()
        cfg, agent = self.config, self._agent
        register = RegisterMsg(
            cfg.engine_id,
            cfg.incarnation,
            agent.name,
            agent.metadata,
            PoolDescMsg.from_dict(agent.descriptor.to_json()),
            self.layout,
        )
        self.links = PrefillLinkManager(cfg, self.client, register, self._on_link_lost)
        self._handshake = Handshake(
            cfg, self.client, self.links, self.table, self.counters, self.fail
        )
        self._fence = FenceManager(cfg, self.client, self._on_fence_lifted)
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
        if self.links is not None:
            await self.links.close()
        if self._fence is not None:
            await self._fence.close(grace_s=self.config.request_timeout_s)
        await self.client.close()
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
        assert self._handshake is not None  # made in start(), like the agent
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
        self.counters.rooms_opened += 1
        # Writes into our pages need our agent's polling to progress: warm until the room
        # ends, or, when it ends fenced (a write may still land), until the fence lifts.
        agent.hold_warm()
        self._spawn(self._handshake.run(room), f"kv-boot-{room_id}")
        return room

    def abort(self, room_id: str, reason: str = "aborted") -> bool:
        """Fail a live room and tell the prefill side. False if the room already ended."""
        return self.table.abort(room_id, reason)

    @property
    def stats(self) -> dict[str, int | float]:
        """Counters of this receiver, its fence, its faults and its live rooms."""
        out: dict[str, int | float] = asdict(self.counters)
        if self._fence is not None:
            out.update(asdict(self._fence.stats))
            out["num_fenced"] = self._fence.num_fenced
            out["num_fenced_pages"] = self._fence.num_fenced_pages
        out["num_live_rooms"] = len(self.table)
        if self.links is not None:
            out["register_retries"] = self.links.num_register_retries
            out["num_links"] = len(self.links.links())
        if self._faults is not None:
            out.update({f"fault_{k}": v for k, v in asdict(self._faults.stats).items()})
        return out

    def debug_peers(self) -> list[dict[str, Any]]:
        """Prefill links with their live room counts."""
        if self.links is None:
            return []
        now = asyncio.get_running_loop().time()
        peers = [r.peer for r in self.table.rooms()]
        return [
            {**ln.debug_dict(now), "num_rooms": peers.count(ln.key)} for ln in self.links.links()
        ]

    # -- notifications (from the NIXL agent thread, delivered on the loop) ---------------------

    def _on_notif(self, agent_name: str, payload: bytes) -> None:
        try:
            msg = decode_notif(payload)
        except MessageError as e:
            self.counters.bad_notifs += 1
            logger.warning("bad notification from %s: %s", agent_name, e)
            return
        room = self.table.get(msg.room_id)
        if room is None or room.data.get("nonce") != msg.nonce:
            self._on_notif_for_gone_room(msg)
            return
        if agent_name != room.data.get("sender_agent") or msg.incarnation != room.data.get(
            "sender_incarnation"
        ):
            self.counters.stale_rejected += 1
            logger.warning(
                "room=%s notification from %s (incarnation %s) rejected: room is with %s",
                msg.room_id,
                agent_name,
                msg.incarnation,
                room.data.get("sender_agent"),
            )
            return
        if isinstance(msg, AbortNotifMsg):
            self.counters.aborts_received += 1
            room.data.update(peer_aborted=True, sender_fenced=msg.is_fenced)
            self.table.fail(room.room_id, f"aborted: by prefill ({msg.reason})")
        else:
            self._on_data(room, msg)

    def _on_notif_for_gone_room(self, msg: DataNotifMsg | AbortNotifMsg) -> None:
        if isinstance(msg, AbortNotifMsg) and msg.is_fenced and self._fence is not None:
            self._fence.on_ack(msg.nonce)
            return
        self.counters.late_notifs += 1
        logger.debug(
            "room=%s nonce=%d: late %s notification ignored",
            msg.room_id,
            msg.nonce,
            type(msg).__name__,
        )

    def _on_data(self, room: Room, msg: DataNotifMsg) -> None:
        if self._faults is not None and self._faults.should_drop_notif():
            self.counters.notifs_dropped += 1
            return
        if msg.chunk != room.data["next_chunk"]:
            self.fail(
                room, f"transfer_error: chunk {msg.chunk}, expected {room.data['next_chunk']}"
            )
            return
        room.data["next_chunk"] += 1
        self.counters.chunks_received += 1
        if room.state == _BOOTSTRAPPING:
            self.table.fire(room.room_id, BOOTSTRAPPED)
        if room.state == _WAITING:
            self.table.fire(room.room_id, BEGIN_TRANSFER)
        if not msg.is_last:
            self.table.fire(room.room_id, CHUNK_SENT)
            return
        if msg.num_pages > len(room.page_ids):
            self.fail(
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
            self.fail(room, "transfer_error: checksum missing (sender has checksum off)")
            return
        pages = room.page_ids[: msg.num_pages]
        checksum = await page_checksum_off_loop(self.pool.kv, pages)
        if not self.is_live(room):
            return
        if checksum != msg.checksum:
            self.counters.checksum_failures += 1
            self.fail(room, "transfer_error: checksum mismatch")
            return
        self._finish(room)

    def _finish(self, room: Room) -> None:
        if not self.table.fire(room.room_id, TRANSFER_DONE):
            return
        self.counters.rooms_received += 1
        self.counters.bytes_received += room.data["num_pages"] * self.pool.page_bytes
        key = room.data["sender_key"]
        if self._faults is not None and self._faults.should_drop_peer(key) and self.links:
            link = self.links.get(room.data["host"], room.data["port"])
            if link is not None and link.key == key:
                self.links.lose(link, "peer_lost: fault injection", False)

    # -- failure, release, fence ---------------------------------------------------------------

    def fail(self, room: Room, reason: str, sender_dead: bool = False) -> None:
        if self.is_live(room):
            room.data["sender_dead"] = sender_dead
            self.table.fail(room.room_id, reason)

    def _on_link_lost(self, link: PrefillLink, reason: str, is_dead: bool) -> None:
        self.counters.peers_lost += 1
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
            self.counters.released_immediately += 1
            self._release_pages(room.room_id, room.page_ids)
            if data.get("posted", "no") == "no" and (room.reason or "").startswith("aborted"):
                self._spawn(self._tell_unposted_abort(room), f"kv-abort-{room.room_id}")
            return
        assert self._fence is not None
        entry = FenceEntry.of_room(room, asyncio.get_running_loop().time())
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
            await self.client.abort(room.data["host"], room.data["port"], room.room_id, msg)
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

    def is_live(self, room: Room) -> bool:
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
