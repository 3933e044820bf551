"""Peer registries and heartbeats, one per side.

NIXL never tells the passive side that its peer died, and UCX keepalives miss hung or
partitioned peers, so these heartbeats are the only failure detector:

- prefill side, :class:`DecodePeerManager`: the registered decode engines (one incarnation each),
  their last-seen time (every valid request counts) and the incarnations they replaced (a
  message from one of those is stale: 409). The sender sweeps it for peers silent for more than
  two heartbeat intervals.
- decode side, :class:`PrefillLinkManager`: one link per prefill bootstrap address, registered
  with retry/backoff, then heartbeated every interval. No answer for two intervals, an answer from
  a new incarnation (the prefill restarted) or "I do not know you" ends the link.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.transport.bootstrap import (
    BootstrapClient,
    BootstrapError,
    PeerIOError,
    PeerRejectedError,
    PeerUnreachableError,
    ProtocolError,
)
from pdserve.transport.config import TransportConfig, peer_key
from pdserve.transport.messages import HeartbeatMsg, PoolDescMsg, RegisterMsg

logger = logging.getLogger(__name__)

MAX_RETIRED = 1024  # remembered replaced incarnations (bounded: a set per restart, not per room)
MAX_BACKOFF_S = 0.25


# -- prefill side --------------------------------------------------------------------------------


@dataclass(slots=True)
class DecodePeer:
    """One registered life of a decode engine."""

    engine_id: str
    incarnation: str
    agent_name: str
    descriptor: PoolDescMsg
    registered_at: float
    last_seen: float

    @property
    def key(self) -> str:
        """``engine@incarnation``: the peer key rooms are bound to (and the NIXL agent name)."""
        return peer_key(self.engine_id, self.incarnation)

    def debug_dict(self, now: float) -> dict[str, Any]:
        """JSON-able snapshot for /peers."""
        return {
            "engine_id": self.engine_id,
            "incarnation": self.incarnation,
            "agent_name": self.agent_name,
            "num_pages": self.descriptor.num_pages,
            "page_bytes": self.descriptor.page_bytes,
            "age_s": round(now - self.registered_at, 3),
            "last_seen_s_ago": round(now - self.last_seen, 3),
        }


class DecodePeerManager:
    """Registered decode peers of one prefill sender. Single writer: the loop."""

    def __init__(self, lost_after_s: float) -> None:
        self.lost_after_s = lost_after_s
        self._by_engine: dict[str, DecodePeer] = {}
        self._retired: OrderedDict[tuple[str, str], None] = OrderedDict()
        # Latest incarnation seen per engine, kept after the peer is forgotten (lost), so that a
        # restart after a loss still retires the previous life.
        self._latest: OrderedDict[str, str] = OrderedDict()

    def get(self, engine_id: str) -> DecodePeer | None:
        """The current registration of ``engine_id``, if any."""
        return self._by_engine.get(engine_id)

    def by_key(self, key: str) -> DecodePeer | None:
        """The registration whose ``engine@incarnation`` is ``key``, if still current."""
        engine_id, _, incarnation = key.partition("@")
        peer = self._by_engine.get(engine_id)
        return peer if peer is not None and peer.incarnation == incarnation else None

    def peers(self) -> list[DecodePeer]:
        """Current registrations."""
        return list(self._by_engine.values())

    def is_retired(self, engine_id: str, incarnation: str) -> bool:
        """True for an incarnation that a newer one of the same engine replaced."""
        return (engine_id, incarnation) in self._retired

    def check_not_stale(self, engine_id: str, incarnation: str) -> None:
        """Raise 409 for a message from a replaced incarnation."""
        if self.is_retired(engine_id, incarnation):
            raise ProtocolError(
                409,
                "stale_incarnation",
                f"{engine_id}@{incarnation} was replaced by a newer incarnation",
            )

    def require(self, engine_id: str, incarnation: str, now: float) -> DecodePeer:
        """The current registration of this exact incarnation (touched), else 409/404."""
        self.check_not_stale(engine_id, incarnation)
        peer = self._by_engine.get(engine_id)
        if peer is None or peer.incarnation != incarnation:
            raise ProtocolError(404, "unknown_peer", f"{engine_id}@{incarnation}: register first")
        peer.last_seen = now
        return peer

    def add(self, peer: DecodePeer) -> DecodePeer | None:
        """Register ``peer``; returns the live registration it replaced, if any.

        Any earlier incarnation of the same engine (live or already forgotten) is retired.
        """
        old = self._by_engine.get(peer.engine_id)
        self._by_engine[peer.engine_id] = peer
        previous = self._latest.pop(peer.engine_id, None)
        self._latest[peer.engine_id] = peer.incarnation
        while len(self._latest) > MAX_RETIRED:
            self._latest.popitem(last=False)
        if previous is not None and previous != peer.incarnation:
            self._retired[(peer.engine_id, previous)] = None
            while len(self._retired) > MAX_RETIRED:
                self._retired.popitem(last=False)
        return old if old is not None and old.incarnation != peer.incarnation else None

    def remove(self, key: str) -> DecodePeer | None:
        """Forget registration ``key`` (not retired: that life may come back and re-register)."""
        peer = self.by_key(key)
        if peer is not None:
            del self._by_engine[peer.engine_id]
        return peer

    def expired(self, now: float) -> list[DecodePeer]:
        """Peers silent for longer than ``lost_after_s``."""
        return [p for p in self._by_engine.values() if now - p.last_seen > self.lost_after_s]


# -- decode side ---------------------------------------------------------------------------------


class BootstrapFailed(Exception):
    """Registration with a prefill gave up; ``str()`` starts with ``bootstrap_error:``."""


@dataclass(slots=True, eq=False)
class PrefillLink:
    """A registered prefill (one incarnation) at one bootstrap address."""

    host: str
    port: int
    engine_id: str
    incarnation: str
    agent_name: str
    last_ok: float
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        """``engine@incarnation``: the peer key rooms are bound to (and the NIXL agent name)."""
        return peer_key(self.engine_id, self.incarnation)

    def debug_dict(self, now: float) -> dict[str, Any]:
        """JSON-able snapshot for debug_peers()."""
        return {
            "address": f"{self.host}:{self.port}",
            "engine_id": self.engine_id,
            "incarnation": self.incarnation,
            "agent_name": self.agent_name,
            "last_ok_s_ago": round(now - self.last_ok, 3),
        }


LostCallback = Callable[[PrefillLink, str, bool], None]  # (link, reason, is_dead)


class PrefillLinkManager:
    """Registration and heartbeats towards prefill bootstrap servers (decode side)."""

    def __init__(
        self,
        config: TransportConfig,
        client: BootstrapClient,
        register_msg: RegisterMsg,
        on_lost: LostCallback,
    ) -> None:
        self.config = config
        self.client = client
        self.register_msg = register_msg
        self.on_lost = on_lost
        self.num_lost = 0
        self.num_register_retries = 0  # failed registration attempts that were retried
        self._loop = asyncio.get_running_loop()
        self._links: dict[tuple[str, int], PrefillLink] = {}
        self._connecting: dict[tuple[str, int], asyncio.Task[PrefillLink]] = {}

    def links(self) -> list[PrefillLink]:
        """Registered prefill links."""
        return list(self._links.values())

    def get(self, host: str, port: int) -> PrefillLink | None:
        """The link to ``host:port``, if registered."""
        return self._links.get((host, port))

    async def connect(self, host: str, port: int, deadline_at: float) -> PrefillLink:
        """The link to ``host:port``, registering first if needed (shared by concurrent callers).

        Retries with backoff until ``deadline_at`` (loop time), but raises
        :class:`BootstrapFailed` once connections were refused for ``connect_timeout_s``.
        """
        addr = (host, port)
        link = self._links.get(addr)
        if link is not None:
            return link
        task = self._connecting.get(addr)
        if task is None:
            task = self._loop.create_task(self._register(host, port, deadline_at))
            self._connecting[addr] = task
            task.add_done_callback(lambda t: self._connecting.pop(addr, None))
        timeout = max(0.0, deadline_at - self._loop.time())
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            raise BootstrapFailed(
                f"bootstrap_error: {host}:{port} registration timed out"
            ) from None

    def lose(self, link: PrefillLink, reason: str, is_dead: bool) -> None:
        """End ``link`` (idempotent): stop its heartbeats and tell the owner."""
        if self._links.get((link.host, link.port)) is not link:
            return
        del self._links[(link.host, link.port)]
        self.num_lost += 1
        if link.task is not None and link.task is not asyncio.current_task():
            link.task.cancel()
        logger.warning("prefill %s at %s:%d lost: %s", link.key, link.host, link.port, reason)
        self.on_lost(link, reason, is_dead)

    async def close(self) -> None:
        """Cancel registrations and heartbeats (no callbacks)."""
        tasks = [t for t in self._connecting.values()]
        tasks += [link.task for link in self._links.values() if link.task is not None]
        self._links.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _register(self, host: str, port: int, deadline_at: float) -> PrefillLink:
        refused_since: float | None = None
        delay = 0.02
        last_error = "no attempt"
        while True:
            try:
                reply = await self.client.register(host, port, self.register_msg)
            except PeerUnreachableError as e:
                now = self._loop.time()
                refused_since = now if refused_since is None else refused_since
                if now - refused_since >= self.config.connect_timeout_s:
                    raise BootstrapFailed(
                        f"bootstrap_error: {host}:{port} refused connections for "
                        f"{now - refused_since:.2f}s ({e})"
                    ) from None
                last_error = str(e)
            except PeerRejectedError as e:
                if e.status < 500:  # a clear refusal: retrying would not change the answer
                    raise BootstrapFailed(f"bootstrap_error: register rejected: {e}") from None
                refused_since, last_error = None, str(e)
            except PeerIOError as e:
                refused_since, last_error = None, str(e)
            else:
                return self._add_link(
                    host, port, reply.engine_id, reply.incarnation, reply.agent_name
                )
            remaining = deadline_at - self._loop.time()
            if remaining <= 0:
                raise BootstrapFailed(f"bootstrap_error: {host}:{port}: {last_error}")
            self.num_register_retries += 1
            await asyncio.sleep(min(delay, remaining))  # retry backoff, not synchronisation
            delay = min(delay * 2, MAX_BACKOFF_S)

    def _add_link(
        self, host: str, port: int, engine_id: str, incarnation: str, agent_name: str
    ) -> PrefillLink:
        link = PrefillLink(host, port, engine_id, incarnation, agent_name, self._loop.time())
        self._links[(host, port)] = link
        link.task = self._loop.create_task(self._heartbeat_loop(link), name=f"hb-{link.key}")
        logger.info("registered with prefill %s at %s:%d", link.key, host, port)
        return link

    async def _heartbeat_loop(self, link: PrefillLink) -> None:
        interval = self.config.heartbeat_interval_s
        msg = HeartbeatMsg(self.config.engine_id, self.config.incarnation)
        next_at = self._loop.time()
        while self._links.get((link.host, link.port)) is link:
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - self._loop.time()))  # heartbeat cadence
            try:
                reply = await self.client.heartbeat(link.host, link.port, msg, interval)
            except BootstrapError as e:
                silent_s = self._loop.time() - link.last_ok
                if silent_s >= self.config.peer_lost_after_s:
                    self.lose(
                        link, f"peer_lost: no heartbeat answer for {silent_s:.2f}s ({e})", True
                    )
                    return
                continue
            if reply.incarnation != link.incarnation:
                self.lose(link, f"peer_lost: prefill restarted as {reply.incarnation}", True)
                return
            if not reply.is_known:
                self.lose(link, "peer_lost: prefill no longer knows this decode", False)
                return
            link.last_ok = self._loop.time()
