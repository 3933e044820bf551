"""KVSender: the prefill side of KV rooms (bootstrap server, page WRITEs, aborts, liveness).

A sender room opens from either end: the engine's :meth:`KVSender.open_room` (request arrived)
or the decode's ``POST /rooms/{id}`` (destination pages); the second contact attaches to the
room the first created. The transfer starts once both the destination pages and the engine's
:meth:`KVSender.send` are there; the writes themselves are :mod:`pdserve.transport.writer`'s.

A room's *write window* is open from the start of its transfer until its task ends. The window
is what aborts wait for: the source pages go back to the engine and a decode-side abort is
acked only once no write for that room can still land.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from pdserve.fsm import (
    BOOTSTRAPPED,
    DuplicateRoomError,
    Room,
    RoomSide,
    RoomState,
    RoomTable,
)
from pdserve.kernels.kv_cache import KVPagePool
from pdserve.kernels.kv_ready import ALWAYS_READY, KVReady
from pdserve.transport.bootstrap import BootstrapServer, ProtocolError
from pdserve.transport.config import TransportConfig, peer_key
from pdserve.transport.faults import maybe_injector
from pdserve.transport.layout import layout_of
from pdserve.transport.liveness import DecodePeerManager
from pdserve.transport.messages import (
    AbortMsg,
    AbortNotifMsg,
    AbortReplyMsg,
    HeartbeatMsg,
    HeartbeatReplyMsg,
    RegisterMsg,
    RegisterReplyMsg,
    RoomMsg,
)
from pdserve.transport.nixl_agent import KVAgent, TransferError
from pdserve.transport.observer import TransferObserver
from pdserve.transport.registrar import PeerRegistrar
from pdserve.transport.sender_state import SenderState
from pdserve.transport.stats import SenderStats
from pdserve.transport.wire import encode
from pdserve.transport.writer import RoomWriter

logger = logging.getLogger(__name__)

_FAILED = RoomState.FAILED.value
_WAITING = RoomState.WAITING_FOR_INPUT.value


class KVSender:
    """Prefill side of the KV transport. All methods run on the event loop."""

    def __init__(
        self,
        config: TransportConfig,
        pool: KVPagePool,
        on_release: Callable[[str, list[int]], None],
        observer: TransferObserver | None = None,
    ) -> None:
        table = RoomTable(RoomSide.SENDER, config.deadlines, on_release=self._on_room_release)
        layout = layout_of(
            pool, config.model_name, config.model_fingerprint, config.weights_fingerprint
        )
        peers = DecodePeerManager(config.peer_lost_after_s)
        # What the writer and the registrar share with us (they never see the sender itself).
        self.state = SenderState(config, pool, table, peers, maybe_injector(config.faults), layout)
        self.config, self.pool, self.table, self.peers = config, pool, table, peers
        self.faults, self.layout = self.state.faults, layout
        self.counters: SenderStats = self.state.counters
        self.writes = self.state.writes  # (decode peer key, nonce) -> room, window open
        self._on_release = on_release
        self._server = BootstrapServer(
            self, config.bootstrap_host, config.bootstrap_port, config.max_room_pages,
            config.bootstrap_token, config.tls.server_context(),
        )  # fmt: skip
        self.registrar = PeerRegistrar(self.state, self.release_src, self.prune_aborts)
        self._writer = RoomWriter(
            self.state, observer or TransferObserver(), self.after_write, self.registrar.lose
        )
        self._recent_aborts: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._tasks = self.state.tasks
        self._sweeper: asyncio.Task[None] | None = None
        self._is_stopping = False

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def bootstrap_port(self) -> int:
        """The port the bootstrap server listens on (the real one once started)."""
        return self._server.port

    @property
    def agent(self) -> KVAgent:
        """The NIXL agent (after start())."""
        return self.state.agent

    async def start(self) -> None:
        """Start the NIXL agent, the bootstrap server and the liveness sweep."""
        loop = asyncio.get_running_loop()
        agent = KVAgent(self.config.peer_key, self.pool, loop, self._on_notif)
        self.state.started_agent = agent
        agent.start()
        await self._server.start()
        self._sweeper = loop.create_task(self.registrar.sweep_loop(), name="kv-sender-liveness")
        logger.info(
            "sender %s started, bootstrap port %d", self.config.peer_key, self.bootstrap_port
        )

    async def stop(self) -> None:
        """Fail live rooms (shutdown), stop serving, and close the agent."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._is_stopping = True  # new registrations and rooms get 503 from here on
        self.table.close("shutdown")
        if self._tasks:  # abort notifications and write windows of those rooms: bounded wait
            await asyncio.wait(set(self._tasks), timeout=self.config.request_timeout_s)
        await self._server.stop()  # served until now: the decode could still ask for its acks
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.state.started_agent is not None:
            await self.state.started_agent.close()
        logger.info("sender %s stopped", self.config.peer_key)

    # -- engine API ----------------------------------------------------------------------------

    def open_room(self, room_id: str, request_id: str) -> Room:
        """Open (or attach to, if the decode posted first) the room of a request that arrived.

        Raises DuplicateRoomError when the engine already opened a live room with this id.
        """
        room = self.table.get(room_id)
        if room is not None:
            if room.data.get("opened"):
                self.counters.duplicate_rejected += 1
                raise DuplicateRoomError(f"room {room_id!r} is already open on the sender")
            room.request_id = request_id
        else:
            room = self.table.create(room_id, request_id=request_id)
        room.data["opened"] = True
        self.counters.rooms_opened += 1
        aborted = self._recent_aborts.pop(room_id, None)
        if aborted is not None:  # the decode gave up on it before the request got here
            self.table.fail(room_id, aborted[1])
        logger.debug("room=%s req=%s opened on sender (state %s)", room_id, request_id, room.state)
        return room

    def send(
        self,
        room_id: str,
        page_ids: list[int],
        num_tokens: int,
        first_token: int,
        first_logprob: float | None = None,
        first_top_logprobs: tuple[tuple[int, float], ...] = (),
        kv_ready: KVReady = ALWAYS_READY,
    ) -> bool:
        """Hand the prefilled KV pages of a live room to the transport (it now owns them).

        The first token (and its logprobs, if asked for) travel in the last chunk's notification.
        No WRITE is posted before ``kv_ready`` completed (the forward that wrote the pages is
        done on the device). Returns False, leaving the pages with the caller, when the room is
        no longer live.
        """
        room = self.table.get(room_id)
        if room is None:
            return False
        if room.page_ids:
            raise RuntimeError(f"room {room_id!r}: send() called twice")
        if not page_ids:
            raise ValueError(f"room {room_id!r}: send() needs at least one page")
        room.page_ids = list(page_ids)
        room.data["num_tokens"] = num_tokens
        room.data["first_token"] = first_token
        room.data["first_logprob"] = first_logprob
        room.data["first_top_logprobs"] = tuple(first_top_logprobs)
        room.data["kv_ready"] = kv_ready
        if room.state == _WAITING:
            self._begin(room)
        return True

    def abort(self, room_id: str, reason: str = "aborted") -> bool:
        """Fail a live room and tell the decode side. False if the room already ended."""
        return self.table.abort(room_id, reason)

    @property
    def stats(self) -> dict[str, int | float]:
        """Counters of this sender, its server, its faults, and its live rooms."""
        out: dict[str, int | float] = asdict(self.counters)
        server = self._server.stats
        out.update(bad_requests=server.bad_requests, http_requests=server.requests)
        out["num_peers"] = len(self.peers.peers())
        out["num_writes_outstanding"] = len(self.writes)
        out["num_live_rooms"] = len(self.table)
        if self.faults is not None:
            out.update({f"fault_{k}": v for k, v in asdict(self.faults.stats).items()})
        return out

    def debug_peers(self) -> list[dict[str, Any]]:
        """Registered decode peers with their room and write counts."""
        now = asyncio.get_running_loop().time()
        rooms = [r.peer for r in self.table.rooms()]
        writes = [k[0] for k in self.writes]
        return [
            {
                **p.debug_dict(now),
                "num_rooms": rooms.count(p.key),
                "num_writes": writes.count(p.key),
            }
            for p in self.peers.peers()
        ]

    # -- bootstrap handlers (BootstrapHandler) -------------------------------------------------

    async def on_register(self, msg: RegisterMsg) -> RegisterReplyMsg:
        """A decode incarnation registers; a new incarnation replaces (and fails) the old one."""
        self._check_open()
        return await self.registrar.register(msg)

    def on_room(self, room_id: str, msg: RoomMsg) -> None:
        """Destination pages of a room: create it or attach to the engine's room."""
        self._check_open()
        peer = self.registrar.require(msg.engine_id, msg.incarnation)
        if max(msg.page_ids) >= peer.descriptor.num_pages:
            raise ProtocolError(
                400, "bad_page_ids", f"page id beyond the decode pool ({peer.descriptor.num_pages})"
            )
        aborted = self._recent_aborts.get(room_id)
        if aborted is not None:
            self.counters.late_rejected += 1
            raise ProtocolError(410, "aborted", f"room {room_id!r} already ended: {aborted[1]}")
        room = self.table.get(room_id)
        if room is None:
            room = self.table.create(room_id, peer=peer.key)
        elif "dst" in room.data:
            self.counters.duplicate_rejected += 1
            raise ProtocolError(409, "duplicate_room", f"room {room_id!r} already has its pages")
        else:
            self.table.bind_peer(room_id, peer.key)
        room.data.update(
            dst=msg.page_ids, skip=msg.num_cached_pages, nonce=msg.nonce, agent=peer.agent_name
        )
        self.table.fire(room_id, BOOTSTRAPPED)
        if room.page_ids:  # the engine's send() came first
            self._begin(room)

    def on_abort(self, room_id: str, msg: AbortMsg) -> AbortReplyMsg:
        """The decode aborted its room (or asks again whether the fence can lift)."""
        self.registrar.check_stale(msg.engine_id, msg.incarnation)
        key = peer_key(msg.engine_id, msg.incarnation)
        self.registrar.touch(msg.engine_id, msg.incarnation)
        self.counters.aborts_received += 1
        room = self.table.get(room_id)
        reason = f"aborted: by decode ({msg.reason})"
        if room is not None and room.data.get("nonce", msg.nonce) == msg.nonce:
            if room.peer in (None, key):
                room.data["peer_aborted"] = True
                self.table.fail(room_id, reason)
        elif room is None:
            self._remember_abort(room_id, reason)
        is_acked = (key, msg.nonce) not in self.writes
        if not is_acked:
            self.counters.acks_deferred += 1
        return AbortReplyMsg(self.config.engine_id, self.config.incarnation, is_acked)

    def on_heartbeat(self, msg: HeartbeatMsg) -> HeartbeatReplyMsg:
        """Record the decode's liveness; tell it whether we still know this incarnation."""
        self.registrar.check_stale(msg.engine_id, msg.incarnation)
        is_known = self.registrar.touch(msg.engine_id, msg.incarnation)
        return HeartbeatReplyMsg(self.config.engine_id, self.config.incarnation, is_known)

    # -- transfer (the writes themselves: pdserve.transport.writer) --------------------------

    def _begin(self, room: Room) -> None:
        self._writer.begin(room)

    def after_write(self, room: Room) -> None:
        """The room's write window closed: release what waited for it."""
        if room.is_terminal:
            if room.state == _FAILED and self._should_notify(room):
                self._notify_abort(room, is_fenced=True)
            self.release_src(room)
        if room.peer is not None and self.peers.by_key(room.peer) is None:
            self.spawn(self.registrar.remove_agent(room.peer), f"kv-forget-{room.peer}")

    # -- room release, aborts, peers -----------------------------------------------------------

    def _on_room_release(self, room: Room) -> None:
        """Table callback on Success/Failed: free or defer (write window open) the src pages."""
        if room.state == _FAILED and ("dst" not in room.data or not room.data.get("opened")):
            # One end never showed up: remember the outcome, so that its late first contact (a
            # dst post: 410; the engine's open_room: a failed room) does not open a ghost room.
            self._remember_abort(room.room_id, room.reason or "aborted")
        if room.data.get("writing"):
            if room.state == _FAILED and self._should_notify(room):
                self._notify_abort(room, is_fenced=False)  # fenced follows when the write ends
            return
        if room.state == _FAILED and self._should_notify(room):
            self._notify_abort(room, is_fenced=True)
        self.release_src(room)

    def release_src(self, room: Room) -> None:
        if not room.page_ids or room.data.get("released"):
            return
        room.data["released"] = True
        try:
            self._on_release(room.room_id, room.page_ids)
        except Exception:
            logger.exception("room=%s on_release failed", room.room_id)

    def _should_notify(self, room: Room) -> bool:
        if "dst" not in room.data or room.data.get("peer_aborted") or room.data.get("peer_gone"):
            return False
        return room.peer is not None and self.peers.by_key(room.peer) is not None

    def _notify_abort(self, room: Room, is_fenced: bool) -> None:
        msg = AbortNotifMsg(
            room.room_id, room.data["nonce"], self.config.incarnation, room.reason or "", is_fenced
        )
        self.counters.aborts_sent += 1
        self.spawn(self._send_notif(room.data["agent"], msg), f"kv-abort-{room.room_id}")

    async def _send_notif(self, agent_name: str, msg: AbortNotifMsg) -> None:
        try:
            await asyncio.wait_for(
                self.agent.send_notif(agent_name, encode(msg)), self.config.request_timeout_s
            )
        except (TransferError, TimeoutError) as e:  # the decode's fence retries cover a loss
            logger.info("room=%s abort notification to %s failed: %s", msg.room_id, agent_name, e)

    # -- helpers -------------------------------------------------------------------------------

    def spawn(self, coro: Any, name: str) -> None:
        self.state.spawn(coro, name)

    def _remember_abort(self, room_id: str, reason: str) -> None:
        now = asyncio.get_running_loop().time()
        self._recent_aborts[room_id] = (now + self.config.deadlines.bootstrapping_s, reason)
        self._recent_aborts.move_to_end(room_id)
        self.prune_aborts(now)

    def prune_aborts(self, now: float) -> None:
        """Forget aborted room ids past their window (and beyond ``max_recent_aborts``)."""
        recent = self._recent_aborts
        while recent and (
            len(recent) > self.config.max_recent_aborts or next(iter(recent.values()))[0] < now
        ):
            recent.popitem(last=False)

    def _check_open(self) -> None:
        if self._is_stopping:
            raise ProtocolError(503, "shutting_down", f"{self.config.peer_key} is stopping")

    def _on_notif(self, agent_name: str, payload: bytes) -> None:
        # The decode side talks to us over HTTP only; anything arriving here is unexpected.
        logger.debug("sender: ignoring notification from %s (%d bytes)", agent_name, len(payload))
