"""KVAgent: one NIXL agent, driven by its own thread, with results handed to the event loop.

The event loop never calls NIXL: it queues commands (closures) for the agent's thread
(:mod:`pdserve.transport.agent_thread`, which also explains the polling) and gets results back
through ``loop.call_soon_threadsafe``. This class is the loop side: peers, outstanding counts and
stats have the loop as their only writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.kernels.kv_cache import KVPagePool
from pdserve.transport.agent_config import (
    KVAgentConfig,
    KVAgentStats,
    TransferError,
    as_transfer_error,
    settle,
)
from pdserve.transport.agent_thread import AgentThread
from pdserve.transport.descriptors import PoolDescriptor, page_indices

logger = logging.getLogger(__name__)

__all__ = ["KVAgent", "KVAgentConfig", "KVAgentStats", "PoolDescriptor", "TransferError"]


@dataclass(frozen=True, slots=True)
class _Peer:
    metadata: bytes
    descriptor: PoolDescriptor


class KVAgent:
    """Owns one NIXL agent (UCX, no NIXL progress thread) and the one thread that drives it.

    ``on_notif(remote_agent_name, msg)`` runs on the event loop for every notification received,
    including those attached to a peer's writes (delivered after that write's data has landed).
    """

    def __init__(
        self,
        name: str,
        pool: KVPagePool,
        loop: asyncio.AbstractEventLoop,
        on_notif: Callable[[str, bytes], None],
        config: KVAgentConfig | None = None,
    ) -> None:
        self.name = name
        self.pool = pool
        self.config = config or KVAgentConfig()
        self.descriptor = PoolDescriptor.of_pool(pool)
        self.stats = KVAgentStats()
        self._loop = loop
        self._on_notif = on_notif
        self._peers: dict[str, _Peer] = {}
        self._adding: dict[str, asyncio.Future[None]] = {}
        self._outstanding: dict[str, int] = {}
        self._is_closing = False
        self._closed: asyncio.Future[None] | None = None
        self._thread: AgentThread | None = None

    @property
    def metadata(self) -> bytes:
        """This agent's NIXL metadata (what a peer loads to reach it); empty before start()."""
        return self._thread.metadata if self._thread is not None else b""

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Create the NIXL agent on its thread and register the pool; blocks until ready (~0.5 s).

        Call it once at process start-up, before serving: UCX initialisation is slow.
        """
        if self._thread is not None:
            raise RuntimeError(f"KV agent {self.name} already started")
        closed = self._closed = self._loop.create_future()
        self._thread = AgentThread(
            self.name, self.pool, self.descriptor, self.config, self._to_loop,
            self._deliver_notifs,
        )  # fmt: skip
        try:
            self._thread.start(on_exit=lambda: self._to_loop(settle, closed, None, None))
        except TransferError:
            self._is_closing = True
            raise
        logger.info("KV agent %s started (%s)", self.name, self.descriptor)

    async def close(self) -> None:
        """Stop accepting work, let in-flight writes finish (bounded), release everything.

        Writes still in flight after ``close_timeout_s`` fail with :class:`TransferError`.
        """
        if self._thread is None or self._closed is None:
            return
        if not self._is_closing:
            self._is_closing = True
            self._peers.clear()
            self._submit(self._thread.request_stop, lambda _e: None)
        limit = self.config.close_timeout_s + self.config.op_timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(self._closed), limit)
        except TimeoutError:
            logger.warning("KV agent %s: thread did not stop within %.1fs", self.name, limit)
            return
        self._thread.join(1.0)
        logger.info("KV agent %s closed", self.name)

    # -- peers -------------------------------------------------------------------------------------

    def has_peer(self, agent_name: str) -> bool:
        """Whether ``agent_name`` was added (and not removed): writes to it can be attempted."""
        return agent_name in self._peers

    def peers(self) -> list[str]:
        """Names of the current peers."""
        return list(self._peers)

    async def add_peer(self, agent_name: str, metadata: bytes, descriptor: PoolDescriptor) -> None:
        """Load a peer's metadata and prepare its page descriptors (once per peer).

        Re-adding a known peer with the same metadata is a no-op; with different metadata it is
        a ``ValueError`` (remove it first: a restarted peer comes with a new agent name anyway).
        Concurrent calls for one name share the first call's work.
        """
        self._check_open()
        known = self._peers.get(agent_name)
        if known is not None:
            if known == _Peer(bytes(metadata), descriptor):
                return
            raise ValueError(f"peer {agent_name!r} already added with other metadata")
        if agent_name == self.name:
            raise ValueError("an agent cannot be its own peer")
        pending = self._adding.get(agent_name)
        if pending is None:
            pending = self._call(
                lambda: self._t().add_peer(agent_name, bytes(metadata), descriptor)
            )
            self._adding[agent_name] = pending
            pending.add_done_callback(lambda f: self._on_added(agent_name, metadata, descriptor, f))
        await self._wait_op(pending, f"add_peer({agent_name})")

    def _on_added(
        self, name: str, metadata: bytes, desc: PoolDescriptor, fut: asyncio.Future[None]
    ) -> None:
        self._adding.pop(name, None)
        if fut.cancelled() or fut.exception() is not None or self._is_closing:
            return
        self._peers[name] = _Peer(bytes(metadata), desc)
        self.stats.num_peers_added += 1
        logger.info("KV agent %s: peer %s added (%d pages)", self.name, name, desc.num_pages)

    async def remove_peer(self, agent_name: str) -> None:
        """Forget a peer: its metadata and descriptors. Idempotent.

        Writes to it still in flight fail with :class:`TransferError`; NIXL cannot recall bytes
        already on the wire, so a receiver must fence its pages by other means (quarantine).
        """
        pending = self._adding.get(agent_name)
        if pending is not None:  # let a concurrent add finish first, whatever its outcome
            with contextlib.suppress(TransferError):
                await self._wait_op(pending, f"add_peer({agent_name})")
        if self._peers.pop(agent_name, None) is None or self._is_closing:
            return
        self.stats.num_peers_removed += 1
        logger.info("KV agent %s: removing peer %s", self.name, agent_name)
        await self._wait_op(
            self._call(lambda: self._t().remove_peer(agent_name)), f"remove_peer({agent_name})"
        )

    # -- data path ---------------------------------------------------------------------------------

    async def write(
        self, agent_name: str, src_pages: Sequence[int], dst_pages: Sequence[int], notif: bytes
    ) -> None:
        """WRITE local ``src_pages`` into the peer's ``dst_pages``, ``notif`` attached.

        NIXL merges runs that are contiguous on both sides into one descriptor. Resolves when
        the transfer is DONE (the peer then gets ``notif`` after the data); raises
        :class:`TransferError` on failure. Cancelling the caller does not recall the transfer:
        it stays counted in :meth:`outstanding_for` until NIXL reports it finished.
        """
        self._check_open()
        peer = self._peers.get(agent_name)
        if peer is None:
            raise TransferError(f"write to unknown peer {agent_name!r}")
        src = page_indices(src_pages, self.descriptor.num_pages, "src_pages")
        dst = page_indices(dst_pages, peer.descriptor.num_pages, "dst_pages")
        if len(src) != len(dst) or len(src) == 0:
            raise ValueError(f"page lists must be equal and non-empty ({len(src)}/{len(dst)})")
        fut: asyncio.Future[None] = self._loop.create_future()
        num_bytes = len(src) * self.descriptor.page_bytes
        self._outstanding[agent_name] = self._outstanding.get(agent_name, 0) + 1

        def done(err: BaseException | None) -> None:  # on the thread
            self._to_loop(self._write_done, agent_name, fut, num_bytes, err)

        self._submit(lambda: self._t().write(agent_name, src, dst, bytes(notif), done), done)
        # no shield: cancelling ``fut`` is harmless, the counts are settled by _write_done
        try:
            async with asyncio.timeout(self.config.write_timeout_s):
                await fut
        except TimeoutError:
            raise TransferError(f"write to {agent_name} timed out") from None

    def _write_done(
        self, peer: str, fut: asyncio.Future[None], num_bytes: int, err: BaseException | None
    ) -> None:
        left = self._outstanding.get(peer, 0) - 1
        if left > 0:
            self._outstanding[peer] = left
        else:
            self._outstanding.pop(peer, None)
        if err is None:
            self.stats.num_writes += 1
            self.stats.num_bytes_written += num_bytes
        else:
            self.stats.num_write_errors += 1
            logger.warning("KV agent %s: write to %s failed: %s", self.name, peer, err)
        settle(fut, None, err)

    async def send_notif(self, agent_name: str, msg: bytes) -> None:
        """A standalone notification (control messages only: it can overtake a write's data)."""
        self._check_open()
        if agent_name not in self._peers:
            raise TransferError(f"notification to unknown peer {agent_name!r}")
        await self._wait_op(
            self._call(lambda: self._t().send_notif(agent_name, bytes(msg))), "send_notif"
        )
        self.stats.num_notifs_sent += 1

    @property
    def num_outstanding(self) -> int:
        """Writes submitted and not yet reported finished by NIXL (all peers)."""
        return sum(self._outstanding.values())

    def outstanding_for(self, agent_name: str) -> int:
        """Writes to ``agent_name`` submitted and not yet reported finished."""
        return self._outstanding.get(agent_name, 0)

    def thread_cpu_s(self) -> float:
        """CPU seconds used so far by the agent's thread (0.0 before start / after exit)."""
        return self._thread.cpu_s() if self._thread is not None else 0.0

    def hold_warm(self) -> None:
        """Poll at ``idle_wait_s`` at least until the matching :meth:`release_warm`.

        A receiver holds it per room that expects writes: they need its polling to progress,
        and their notifications are then seen within ~1 ms even after a quiet spell.
        """
        if self._thread is not None:
            self._thread.num_warm_holds += 1
            self._thread.wake()

    def release_warm(self) -> None:
        """Undo one :meth:`hold_warm`."""
        if self._thread is not None:
            self._thread.num_warm_holds = max(0, self._thread.num_warm_holds - 1)

    def debug_dict(self) -> dict[str, Any]:
        """A JSON-able snapshot for /debug endpoints."""
        return {
            "name": self.name,
            "peers": list(self._peers),
            "outstanding": dict(self._outstanding),
            "closing": self._is_closing,
            "warm_holds": self._thread.num_warm_holds if self._thread is not None else 0,
            "polls": self._thread.num_polls if self._thread is not None else 0,
            "descriptor": self.descriptor.to_json(),
        }

    # -- loop-side plumbing ---------------------------------------------------------------------

    def _t(self) -> AgentThread:
        """The thread, from a command running on it (started, by construction)."""
        assert self._thread is not None
        return self._thread

    def _check_open(self) -> None:
        if self._thread is None:
            raise TransferError(f"KV agent {self.name} not started")
        if self._is_closing:
            raise TransferError(f"KV agent {self.name} is closed")

    def _submit(self, run: Callable[[], None], fail: Callable[[BaseException], None]) -> None:
        self._t().submit(run, fail)

    def _call(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run ``fn`` on the agent thread; its result or error settles the returned future."""
        fut: asyncio.Future[Any] = self._loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except Exception as e:
                self._to_loop(settle, fut, None, as_transfer_error(e))
            else:
                self._to_loop(settle, fut, result, None)

        self._submit(run, lambda e: self._to_loop(settle, fut, None, e))
        return fut

    async def _wait_op(self, fut: asyncio.Future[Any], what: str) -> Any:
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.config.op_timeout_s)
        except TimeoutError:
            raise TransferError(f"KV agent {self.name}: {what} timed out") from None

    def _deliver_notifs(self, notifs: dict[Any, list[bytes]]) -> None:
        for raw_name, msgs in notifs.items():
            name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
            for msg in msgs:
                self.stats.num_notifs_received += 1
                try:
                    self._on_notif(name, msg)
                except Exception:
                    logger.exception("KV agent %s: notification handler failed", self.name)

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """From the thread: run ``fn(*args)`` on the loop (dropped if the loop is gone)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            logger.debug("KV agent %s: loop closed, dropping %s", self.name, fn)
