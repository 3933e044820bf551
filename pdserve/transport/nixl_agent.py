"""KVAgent: one NIXL agent, driven by one dedicated thread, with results handed to the event loop.

Why one thread: NIXL 1.5.1's own progress thread spins a core while idle and cuts bandwidth, so
agents are created with ``enable_prog_thread=False`` and progress is ours to drive. Every NIXL call
(creation, registration, peers, transfers, polling) happens on this thread, so the agent can use
``NIXL_THREAD_SYNC_NONE``. The thread polls adaptively (see :class:`KVAgentConfig`): 50 us
while transfers are outstanding, 200 us just after activity (a burst of rooms), 1 ms shortly
after that and for as long as a receiver holds it warm (:meth:`KVAgent.hold_warm`: rooms expect
writes), else 50 ms. A command from the loop wakes it at once. The polling (``get_new_notifs``)
is also what keeps a receiving agent progressing: without it, writes into it stall; with nothing
expected, polling only costs the model's threads (each wake-up preempts one of them).

The event loop never calls NIXL: it queues commands (closures) and gets results back through
``loop.call_soon_threadsafe``. Loop-side state (peers, outstanding counts, stats) has the loop as
its only writer; thread-side state (handles, in-flight transfers) has the thread as its only one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.kernels.kv_cache import KVPagePool
from pdserve.transport.nixl_compat import nixl_agent, nixl_agent_config, nixl_thread_sync_t

logger = logging.getLogger(__name__)

__all__ = ["KVAgent", "KVAgentConfig", "KVAgentStats", "PoolDescriptor", "TransferError"]


class TransferError(RuntimeError):
    """A NIXL operation towards a peer failed, or cannot be attempted (unknown peer, closed)."""


_MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True, slots=True)
class PoolDescriptor:
    """What a peer needs to address our pages: page ``i`` is at ``base + i * page_bytes``.

    Crosses the wire as JSON (``to_json``/``from_json``), never NIXL's pickled descriptor lists.
    """

    base_address: int
    page_bytes: int
    num_pages: int
    device_id: int = 0
    mem_type: str = "DRAM"

    def __post_init__(self) -> None:
        for field_name in ("base_address", "page_bytes", "num_pages", "device_id"):
            v = getattr(self, field_name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"PoolDescriptor.{field_name} must be an int >= 0, got {v!r}")
        if self.page_bytes == 0 or self.num_pages == 0:
            raise ValueError("PoolDescriptor needs page_bytes > 0 and num_pages > 0")
        if self.mem_type not in _MEM_TYPES:
            raise ValueError(f"PoolDescriptor.mem_type must be one of {_MEM_TYPES}")

    @classmethod
    def of_pool(cls, pool: KVPagePool) -> PoolDescriptor:
        """The descriptor of a local page pool (its one contiguous, page-major tensor)."""
        kv = pool.kv
        if not kv.is_contiguous():
            raise ValueError("the KV pool tensor must be contiguous")
        is_cuda = kv.device.type == "cuda"
        return cls(
            base_address=kv.data_ptr(),
            page_bytes=pool.page_bytes,
            num_pages=kv.shape[0],
            device_id=(kv.device.index or 0) if is_cuda else 0,
            mem_type="VRAM" if is_cuda else "DRAM",
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (orjson-ready)."""
        return {
            "base_address": self.base_address,
            "page_bytes": self.page_bytes,
            "num_pages": self.num_pages,
            "device_id": self.device_id,
            "mem_type": self.mem_type,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PoolDescriptor:
        """Validate a dict made by :meth:`to_json` (raises ``ValueError`` on anything else)."""
        if not isinstance(d, dict):
            raise ValueError("PoolDescriptor JSON must be an object")
        try:
            return cls(
                **{k: d[k] for k in ("base_address", "page_bytes", "num_pages")},
                device_id=d.get("device_id", 0),
                mem_type=d.get("mem_type", "DRAM"),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"bad PoolDescriptor JSON: {e}") from None

    def page_descs(self) -> np.ndarray:
        """One NIXL descriptor per page, ``(num_pages, 3)`` uint64 rows (address, length, dev)."""
        out = np.empty((self.num_pages, 3), dtype=np.uint64)
        out[:, 0] = self.base_address + np.arange(self.num_pages, dtype=np.uint64) * np.uint64(
            self.page_bytes
        )
        out[:, 1] = self.page_bytes
        out[:, 2] = self.device_id
        return out


def page_indices(pages: Sequence[int] | np.ndarray, num_pages: int, what: str) -> np.ndarray:
    """Page ids as the int32 index array NIXL takes, bounds-checked (vectorized)."""
    idx = np.asarray(pages, dtype=np.int64).reshape(-1)
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= num_pages):
        raise ValueError(f"{what} out of range [0, {num_pages})")
    return idx.astype(np.int32)


@dataclass(frozen=True, slots=True)
class KVAgentConfig:
    """Knobs of one agent. The defaults are what bench/transfer.py found best on CPU hosts."""

    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = 0  # UCX backend worker threads (0: NIXL default)
    # "none" lets UCX use shared memory for a write's completion and notification: ~10 us per
    # room, and a write completes without waiting for the receiver to poll. "peer" (NIXL's
    # default) excludes shm, so both go over tcp loopback and each write waits ~1 receiver
    # poll period. A killed peer still fails writes in both modes (bench/transfer.py, docs).
    ucx_error_handling_mode: str = "none"
    merge_descs: bool = True  # let NIXL merge runs contiguous on both sides (bench lever only)
    # Polling tiers. A wait ends early when the loop queues a command, so these bound only how
    # late a transfer's completion or an incoming notification is seen. In a VM each timed
    # wake-up costs ~20 us of CPU (and GIL hand-offs slow the loop): 50 us polling burns ~40%
    # of a core, which on a 2-core host made rooms slower, not faster (docs/benchmarks.md).
    busy_wait_s: float = 0.00005  # transfers outstanding (PROC): tight
    hot_wait_s: float = 0.0002  # activity within hot_window_s (a burst of rooms)
    hot_window_s: float = 0.01
    idle_wait_s: float = 0.001  # activity within warm_window_s, or hold_warm() holds
    warm_window_s: float = 0.05
    # Nothing outstanding or expected: a stray notification (a late abort) waits <= 50 ms. At
    # 5 ms, a decode worker's agent woke ~500 times a second during decoding, preempting the
    # step's threads: decode steps were ~10% slower than colocated ones (docs/benchmarks.md).
    cold_wait_s: float = 0.05
    start_timeout_s: float = 30.0  # agent creation takes ~0.5 s (UCX init)
    op_timeout_s: float = 10.0  # add_peer / remove_peer / send_notif
    write_timeout_s: float = 60.0  # safety net; room deadlines normally fire first
    close_timeout_s: float = 5.0  # how long close() lets in-flight writes finish


@dataclass(slots=True)
class KVAgentStats:
    """Plain counters, read by the metrics module at scrape time."""

    num_writes: int = 0
    num_write_errors: int = 0
    num_bytes_written: int = 0
    num_notifs_sent: int = 0
    num_notifs_received: int = 0
    num_peers_added: int = 0
    num_peers_removed: int = 0


@dataclass(frozen=True, slots=True)
class _Peer:
    metadata: bytes
    descriptor: PoolDescriptor


@dataclass(slots=True)
class _Xfer:
    """A posted transfer the thread polls until DONE/ERR (thread-owned)."""

    peer: str
    handle: Any
    done: Callable[[BaseException | None], None]


# A queued command: run() on the thread; fail(err) if the thread will never run it.
_Cmd = tuple[Callable[[], None], Callable[[BaseException], None]]


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
        self.metadata = b""  # set by start()
        self.stats = KVAgentStats()
        self._loop = loop
        self._on_notif = on_notif
        # loop-owned
        self._peers: dict[str, _Peer] = {}
        self._adding: dict[str, asyncio.Future[None]] = {}
        self._outstanding: dict[str, int] = {}
        self._is_closing = False
        self._closed: asyncio.Future[None] | None = None
        # thread-owned
        self._thread: threading.Thread | None = None
        self._start_error: BaseException | None = None
        self._nx: Any = None
        self._reg: Any = None
        self._local_dl: Any = None
        self._peer_dls: dict[str, Any] = {}
        self._inflight: list[_Xfer] = []
        self._zombies: list[Any] = []  # handles whose release failed (kept off the GC's threads)
        self._stop_at: float | None = None
        self._num_polls = 0  # rounds of the serve loop (read, racily, by debug_dict)
        # the hand-off: a deque is safe for one producer (loop) and one consumer (thread)
        self._cmds: deque[_Cmd] = deque()
        # held = no wake pending; the loop releases it to wake the thread (a futex, no Python
        # Condition: the idle wait is the hottest line of an idle process)
        self._wake = threading.Lock()
        self._wake.acquire()
        self._num_warm_holds = 0  # written by the loop (hold_warm/release_warm), read by the thread

    # -- lifecycle (loop side) -------------------------------------------------------------------

    def start(self) -> None:
        """Create the NIXL agent on its thread and register the pool; blocks until ready (~0.5 s).

        Call it once at process start-up, before serving: UCX initialisation is slow.
        """
        if self._thread is not None:
            raise RuntimeError(f"KV agent {self.name} already started")
        self._closed = self._loop.create_future()
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name=f"kv-agent-{self.name}", daemon=True
        )
        self._thread.start()
        if not ready.wait(self.config.start_timeout_s):
            raise TransferError(f"KV agent {self.name}: NIXL start timed out")
        if self._start_error is not None:
            self._is_closing = True
            raise TransferError(f"KV agent {self.name}: {self._start_error}") from self._start_error
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
            self._submit(self._t_request_stop, lambda _e: None)
        limit = self.config.close_timeout_s + self.config.op_timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(self._closed), limit)
        except TimeoutError:
            logger.warning("KV agent %s: thread did not stop within %.1fs", self.name, limit)
            return
        self._thread.join(timeout=1.0)
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
            pending = self._call(lambda: self._t_add_peer(agent_name, bytes(metadata), descriptor))
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
            self._call(lambda: self._t_remove_peer(agent_name)), f"remove_peer({agent_name})"
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

        self._submit(lambda: self._t_write(agent_name, src, dst, bytes(notif), done), done)
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
        _settle(fut, None, err)

    async def send_notif(self, agent_name: str, msg: bytes) -> None:
        """A standalone notification (control messages only: it can overtake a write's data)."""
        self._check_open()
        if agent_name not in self._peers:
            raise TransferError(f"notification to unknown peer {agent_name!r}")
        await self._wait_op(
            self._call(lambda: self._nx.send_notif(agent_name, bytes(msg))), "send_notif"
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
        thread = self._thread
        if thread is None or thread.ident is None or not thread.is_alive():
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except OSError:  # the thread ended in between
            return 0.0

    def hold_warm(self) -> None:
        """Poll at ``idle_wait_s`` at least until the matching :meth:`release_warm`.

        A receiver holds it per room that expects writes: they need its polling to progress,
        and their notifications are then seen within ~1 ms even after a quiet spell.
        """
        self._num_warm_holds += 1
        self._wake_thread()

    def release_warm(self) -> None:
        self._num_warm_holds = max(0, self._num_warm_holds - 1)

    def debug_dict(self) -> dict[str, Any]:
        """A JSON-able snapshot for /debug endpoints."""
        return {
            "name": self.name,
            "peers": list(self._peers),
            "outstanding": dict(self._outstanding),
            "closing": self._is_closing,
            "warm_holds": self._num_warm_holds,
            "polls": self._num_polls,
            "descriptor": self.descriptor.to_json(),
        }

    # -- loop-side plumbing ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._thread is None:
            raise TransferError(f"KV agent {self.name} not started")
        if self._is_closing:
            raise TransferError(f"KV agent {self.name} is closed")

    def _submit(self, run: Callable[[], None], fail: Callable[[BaseException], None]) -> None:
        self._cmds.append((run, fail))
        self._wake_thread()

    def _wake_thread(self) -> None:
        with contextlib.suppress(RuntimeError):  # already released: a wake is pending
            self._wake.release()

    def _call(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run ``fn`` on the agent thread; its result or error settles the returned future."""
        fut: asyncio.Future[Any] = self._loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except Exception as e:
                self._to_loop(_settle, fut, None, _as_transfer_error(e))
            else:
                self._to_loop(_settle, fut, result, None)

        self._submit(run, lambda e: self._to_loop(_settle, fut, None, e))
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

    # -- the agent thread ------------------------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        try:
            self._t_open()
        except Exception as e:
            logger.warning("KV agent %s: NIXL start failed: %s", self.name, e)
            self._start_error = e
            ready.set()
            self._t_shutdown()
            assert self._closed is not None
            self._to_loop(_settle, self._closed, None, None)
            return
        ready.set()
        try:
            self._t_serve()
        except Exception:
            logger.exception("KV agent %s: progress thread crashed", self.name)
        finally:
            self._t_shutdown()
            assert self._closed is not None
            self._to_loop(_settle, self._closed, None, None)

    def _t_open(self) -> None:
        cfg = self.config
        conf = nixl_agent_config(
            enable_prog_thread=False,
            backends=[],  # created below, with our parameters
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,  # only this thread calls NIXL
        )
        self._nx = nixl_agent(self.name, conf)
        for backend in cfg.backends:
            params: dict[str, str] = {}
            if backend == "UCX":
                params["ucx_error_handling_mode"] = cfg.ucx_error_handling_mode
                if cfg.num_threads > 0:
                    params["num_threads"] = str(cfg.num_threads)
            self._nx.create_backend(backend, params)
        self._reg = self._nx.register_memory(self.pool.kv)
        d = self.descriptor
        self._local_dl = self._nx.prep_xfer_dlist("NIXL_INIT_AGENT", d.page_descs(), d.mem_type)
        self.metadata = self._nx.get_agent_metadata()

    def _t_serve(self) -> None:
        cfg = self.config
        last_activity = time.monotonic()
        while True:
            self._num_polls += 1
            is_busy = self._t_drain_commands()
            is_busy |= self._t_poll_inflight()
            is_busy |= self._t_poll_notifs()
            now = time.monotonic()
            if self._stop_at is not None and (not self._inflight or now >= self._stop_at):
                return
            if is_busy:
                last_activity = now
            quiet_s = now - last_activity
            if self._inflight:
                wait_s = cfg.busy_wait_s  # a real sleep, not a spin: the loop needs the GIL
            elif quiet_s < cfg.hot_window_s:
                wait_s = cfg.hot_wait_s
            elif quiet_s < cfg.warm_window_s or self._num_warm_holds > 0:
                wait_s = cfg.idle_wait_s
            else:
                wait_s = cfg.cold_wait_s
            self._wake.acquire(timeout=wait_s)

    def _t_drain_commands(self) -> bool:
        ran = False
        while self._cmds and self._stop_at is None:
            run, _fail = self._cmds.popleft()
            ran = True
            try:
                run()
            except Exception:
                logger.exception("KV agent %s: command failed", self.name)
        return ran

    def _t_poll_inflight(self) -> bool:
        if not self._inflight:
            return False
        still: list[_Xfer] = []
        for x in self._inflight:
            try:
                state = self._nx.check_xfer_state(x.handle)
            except Exception as e:
                state = e
            if state == "PROC":
                still.append(x)
                continue
            self._t_release(x.handle)
            x.done(None if state == "DONE" else _as_transfer_error(state))
        progressed = len(still) != len(self._inflight)
        self._inflight = still
        return progressed

    def _t_poll_notifs(self) -> bool:
        notifs = self._nx.get_new_notifs()  # also what keeps a receiving agent progressing
        if not notifs:
            return False
        self._to_loop(self._deliver_notifs, notifs)
        return True

    def _t_write(
        self,
        peer: str,
        src: np.ndarray,
        dst: np.ndarray,
        notif: bytes,
        done: Callable[[BaseException | None], None],
    ) -> None:
        remote_dl = self._peer_dls.get(peer)
        if remote_dl is None:
            done(TransferError(f"peer {peer!r} was removed"))
            return
        try:
            handle = self._nx.make_prepped_xfer(
                "WRITE",
                self._local_dl,
                src,
                remote_dl,
                dst,
                notif,
                skip_desc_merge=not self.config.merge_descs,
            )
        except Exception as e:
            done(_as_transfer_error(e))
            return
        try:
            state = self._nx.transfer(handle)  # a large room is copied right here (cma)
        except Exception as e:
            state = e
        if state == "PROC":
            self._inflight.append(_Xfer(peer, handle, done))
            return
        self._t_release(handle)
        done(None if state == "DONE" else _as_transfer_error(state))

    def _t_add_peer(self, name: str, metadata: bytes, desc: PoolDescriptor) -> None:
        loaded = self._nx.add_remote_agent(metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            self._nx.remove_remote_agent(loaded)
            raise TransferError(f"metadata is for agent {loaded!r}, not {name!r}")
        try:
            self._peer_dls[name] = self._nx.prep_xfer_dlist(name, desc.page_descs(), desc.mem_type)
            self._nx.make_connection(name)  # connect now: the first room must not pay for it
        except Exception:
            self._t_forget(name)
            raise

    def _t_remove_peer(self, name: str) -> None:
        self._t_forget(name)
        self._t_poll_inflight()  # a write to a removed peer now reports an error: settle it
        for x in [x for x in self._inflight if x.peer == name]:
            self._inflight.remove(x)
            self._t_release(x.handle)
            x.done(TransferError(f"peer {name!r} was removed"))

    def _t_forget(self, name: str) -> None:
        try:
            self._nx.remove_remote_agent(name)
        except Exception as e:
            logger.debug("KV agent %s: remove_remote_agent(%s): %s", self.name, name, e)
        dl = self._peer_dls.pop(name, None)
        if dl is not None:
            self._t_release(dl)

    def _t_request_stop(self) -> None:
        self._stop_at = time.monotonic() + self.config.close_timeout_s

    def _t_release(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception as e:  # an xfer NIXL cannot cancel yet: kept, retried at shutdown
            logger.debug("KV agent %s: release failed: %s", self.name, e)
            self._zombies.append(handle)

    def _t_shutdown(self) -> None:
        closed = TransferError(f"KV agent {self.name} closed")
        for x in self._inflight:
            self._t_release(x.handle)
            x.done(closed)
        self._inflight = []
        while self._cmds:
            _run, fail = self._cmds.popleft()
            fail(closed)
        for name in list(self._peer_dls):
            self._t_forget(name)
        if self._local_dl is not None:
            self._t_release(self._local_dl)
        zombies, self._zombies = self._zombies, []
        for handle in zombies:
            with contextlib.suppress(Exception):  # best effort: the agent is going away
                handle.release()
        try:
            if self._reg is not None:
                self._nx.deregister_memory(self._reg)
        except Exception as e:
            logger.debug("KV agent %s: deregister failed: %s", self.name, e)
        self._nx = None  # the NIXL agent is destroyed here, on its own thread


def _settle(fut: asyncio.Future[Any], result: Any, err: BaseException | None) -> None:
    if fut.done():
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(result)


def _as_transfer_error(e: object) -> TransferError:
    if isinstance(e, TransferError):
        return e
    if isinstance(e, BaseException):
        return TransferError(f"{type(e).__name__}: {e}")
    return TransferError(f"transfer state {e}")
