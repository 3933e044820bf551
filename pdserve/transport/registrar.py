"""The sender's decode peers: registration (layout check, NIXL metadata), liveness and loss.

A registration is checked before anything is loaded (its agent name, its whole KV layout,
its page bytes), then the peer's NIXL metadata is added (one peer operation at a time) and the
peer recorded in the sender's :class:`~pdserve.transport.liveness.DecodePeerManager`. A lost
peer (no heartbeat within two intervals: :meth:`PeerRegistrar.sweep_loop`; a failed write; a
restart) fails its rooms and its metadata is removed once no write of ours still uses it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pdserve.fsm import Room
from pdserve.transport.agent_config import TransferError
from pdserve.transport.bootstrap import ProtocolError
from pdserve.transport.config import peer_key
from pdserve.transport.descriptors import PoolDescriptor
from pdserve.transport.liveness import DecodePeer
from pdserve.transport.messages import RegisterMsg, RegisterReplyMsg
from pdserve.transport.sender_state import SenderState

logger = logging.getLogger(__name__)


class PeerRegistrar:
    """Registers and forgets the decode peers of one sender's :class:`SenderState`.

    ``release_src(room)`` hands a room's source pages back (a lost peer's writes cannot hurt
    them); ``on_sweep(now)`` runs after each liveness sweep (the sender prunes its abort memory).
    """

    def __init__(
        self,
        state: SenderState,
        release_src: Callable[[Room], None],
        on_sweep: Callable[[float], None],
    ) -> None:
        self.state = state
        self._release_src = release_src
        self._on_sweep = on_sweep
        self._lock = asyncio.Lock()  # one NIXL peer operation at a time

    async def register(self, msg: RegisterMsg) -> RegisterReplyMsg:
        """A decode incarnation registers; a new incarnation replaces (and fails) the old one."""
        s = self.state
        key = peer_key(msg.engine_id, msg.incarnation)
        self._check(msg, key)
        async with self._lock:  # one NIXL peer operation at a time
            s.peers.check_not_stale(msg.engine_id, msg.incarnation)
            now = asyncio.get_running_loop().time()
            current = s.peers.get(msg.engine_id)
            if current is not None and current.incarnation == msg.incarnation:
                current.last_seen = now  # a retried registration: idempotent
                return self._reply()
            if not s.agent.has_peer(key):
                await self._add_agent_peer(msg, key)
            peer = DecodePeer(msg.engine_id, msg.incarnation, key, msg.descriptor, now, now)
            old = s.peers.add(peer)
        s.counters.peers_registered += 1
        logger.info("decode peer %s registered (%d pages)", key, msg.descriptor.num_pages)
        if old is not None:
            self.lose(old.key, f"peer_lost: restarted as {msg.incarnation}", True)
        return self._reply()

    async def _add_agent_peer(self, msg: RegisterMsg, key: str) -> None:
        s = self.state
        descriptor = PoolDescriptor(**msg.descriptor.to_dict())
        try:
            await asyncio.wait_for(
                s.agent.add_peer(key, msg.metadata, descriptor), s.config.request_timeout_s
            )
        except TimeoutError:
            raise ProtocolError(503, "register_timeout", f"adding {key} timed out") from None
        except (TransferError, ValueError) as e:  # metadata NIXL cannot load, or not this agent
            raise ProtocolError(400, "bad_metadata", f"{key}: {e}") from None

    def lose(self, key: str, reason: str, is_replaced: bool = False) -> None:
        """Forget a decode incarnation: fail its rooms, free src pages, drop its NIXL metadata."""
        s = self.state
        if s.peers.remove(key) is None and not is_replaced:
            return  # already forgotten (its rooms failed then; new ones cannot bind to it)
        s.counters.peers_lost += 1
        for room in s.table.rooms():
            if room.peer == key:
                room.data["peer_gone"] = True
        s.table.fail_peer(key, reason)
        for (peer, _), room in list(s.writes.items()):
            if peer == key:  # a dead peer's memory cannot hurt our pages: no need to wait
                self._release_src(room)
        logger.warning("decode peer %s lost: %s", key, reason)
        s.spawn(self.remove_agent(key), f"kv-forget-{key}")

    async def remove_agent(self, key: str) -> None:
        """Drop a forgotten peer's NIXL metadata once no write of ours uses it."""
        s = self.state
        async with self._lock:
            if s.peers.by_key(key) is not None or any(p == key for p, _ in s.writes):
                return  # re-registered meanwhile, or a write still uses it (retried after it)
            if s.agent.has_peer(key):
                await s.agent.remove_peer(key)
                logger.info("decode peer %s: NIXL metadata removed", key)

    async def sweep_loop(self) -> None:
        """Every quarter heartbeat: lose peers silent for two intervals; prune abort memory."""
        s = self.state
        period = s.config.heartbeat_interval_s / 4
        loop = asyncio.get_running_loop()
        expected = loop.time() + period
        while True:
            await asyncio.sleep(period)  # liveness sweep cadence
            now = loop.time()
            stalled = now - expected > s.config.heartbeat_interval_s
            expected = now + period
            if stalled:  # this loop was starved: heartbeats may be queued unread, judge next round
                logger.warning("liveness sweep woke %.2fs late; not expiring peers this round",
                               now - expected + period)  # fmt: skip
                continue
            for peer in s.peers.expired(now):
                silent = now - peer.last_seen
                self.lose(peer.key, f"peer_lost: no heartbeat for {silent:.2f}s")
            self._on_sweep(now)

    def check_stale(self, engine_id: str, incarnation: str) -> None:
        """Raise 409 (counted) for a message from a replaced incarnation."""
        try:
            self.state.peers.check_not_stale(engine_id, incarnation)
        except ProtocolError:
            self.state.counters.stale_rejected += 1
            raise

    def require(self, engine_id: str, incarnation: str) -> DecodePeer:
        """The current registration of this incarnation (touched), else 409/404."""
        self.check_stale(engine_id, incarnation)
        return self.state.peers.require(engine_id, incarnation, asyncio.get_running_loop().time())

    def touch(self, engine_id: str, incarnation: str) -> bool:
        """Record a sign of life; False when this incarnation is not (or no longer) registered."""
        peer = self.state.peers.get(engine_id)
        if peer is None or peer.incarnation != incarnation:
            return False
        peer.last_seen = asyncio.get_running_loop().time()
        return True

    def _check(self, msg: RegisterMsg, key: str) -> None:
        s = self.state
        if msg.agent_name != key:
            raise ProtocolError(400, "bad_agent_name", f"agent_name must be {key!r}")
        mismatches = s.layout.mismatches(msg.layout, us="prefill", them="decode")
        if mismatches:
            raise ProtocolError(
                400,
                "layout_mismatch",
                f"KV layout of {key} differs from prefill {s.config.peer_key}: "
                + "; ".join(mismatches),
            )
        if msg.descriptor.page_bytes != s.pool.page_bytes:
            raise ProtocolError(
                400,
                "page_size_mismatch",
                f"decode pages are {msg.descriptor.page_bytes} B, ours {s.pool.page_bytes} B",
            )

    def _reply(self) -> RegisterReplyMsg:
        cfg = self.state.config
        return RegisterReplyMsg(cfg.engine_id, cfg.incarnation, cfg.peer_key)
