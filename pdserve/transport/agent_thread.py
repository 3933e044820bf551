"""The one thread that drives a NIXL agent: creation, registration, peers, WRITEs, polling.

Why one thread: NIXL 1.5.1's own progress thread spins a core while idle and cuts bandwidth, so
agents are created with ``enable_prog_thread=False`` and progress is ours to drive. Every NIXL call
happens on this thread, so the agent can use ``NIXL_THREAD_SYNC_NONE``. The thread polls
adaptively (see :class:`KVAgentConfig`): 50 us while transfers are outstanding, 200 us just after
activity (a burst of rooms), 1 ms shortly after that and for as long as a receiver holds it warm,
else 50 ms. A command from the loop wakes it at once. The polling (``get_new_notifs``) is also what
keeps a receiving agent progressing: without it, writes into it stall; with nothing expected,
polling only costs the model's threads (each wake-up preempts one of them).

A VRAM pool: the thread makes the pool's GPU its current CUDA device before NIXL touches it
(``register_memory`` and UCX's cuda transports work on the calling thread's current device).

The loop talks to it only through :meth:`AgentThread.submit` (closures run on the thread) and
gets results back through ``loop.call_soon_threadsafe``. Everything here that is not marked
otherwise is thread-owned.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.envs import ucx_tls
from pdserve.kernels.kv_cache import KVPagePool
from pdserve.transport.agent_config import KVAgentConfig, TransferError, as_transfer_error
from pdserve.transport.descriptors import PoolDescriptor, cuda_device_of
from pdserve.transport.nixl_compat import nixl_agent, nixl_agent_config, nixl_thread_sync_t

logger = logging.getLogger(__name__)

# A queued command: run() on the thread; fail(err) if the thread will never run it.
Cmd = tuple[Callable[[], None], Callable[[BaseException], None]]
WriteDone = Callable[[BaseException | None], None]


@dataclass(slots=True)
class _Xfer:
    """A posted transfer the thread polls until DONE/ERR."""

    peer: str
    handle: Any
    done: WriteDone


def bind_cuda_device(tensor: Any, set_device: Callable[[int], None] | None = None) -> int | None:
    """Make ``tensor``'s GPU the calling thread's current CUDA device; its ordinal, or None."""
    device = cuda_device_of(tensor)
    if device is not None:
        (set_device or torch.cuda.set_device)(device)
    return device


class AgentThread:
    """Owns the NIXL agent object and every handle made from it, on one daemon thread."""

    def __init__(
        self,
        name: str,
        pool: KVPagePool,
        descriptor: PoolDescriptor,
        config: KVAgentConfig,
        to_loop: Callable[..., None],
        on_notifs: Callable[[dict[Any, list[bytes]]], None],
    ) -> None:
        self.name = name
        self.pool = pool
        self.descriptor = descriptor
        self.config = config
        self.metadata = b""  # set once the agent is open
        self.num_polls = 0  # rounds of the serve loop (read, racily, by debug_dict)
        self.num_warm_holds = 0  # written by the loop (hold_warm/release_warm), read here
        self._to_loop = to_loop  # runs fn(*args) on the loop
        self._on_notifs = on_notifs  # loop side
        self._thread: threading.Thread | None = None
        self._start_error: BaseException | None = None
        self._on_exit: Callable[[], None] = lambda: None
        self._nx: Any = None
        self._reg: Any = None
        self._local_dl: Any = None
        self._peer_dls: dict[str, Any] = {}
        self._inflight: list[_Xfer] = []
        self._zombies: list[Any] = []  # handles whose release failed (kept off the GC's threads)
        self._stop_at: float | None = None
        # the hand-off: a deque is safe for one producer (loop) and one consumer (thread)
        self._cmds: deque[Cmd] = deque()
        # held = no wake pending; the loop releases it to wake the thread (a futex, no Python
        # Condition: the idle wait is the hottest line of an idle process)
        self._wake = threading.Lock()
        self._wake.acquire()

    # -- loop side -------------------------------------------------------------------------------

    def start(self, on_exit: Callable[[], None]) -> None:
        """Start the thread and wait (blocking, ~0.5 s) until NIXL is open; ``on_exit`` runs
        on the thread once it has released everything. Raises :class:`TransferError`."""
        self._on_exit = on_exit
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name=f"kv-agent-{self.name}", daemon=True
        )
        self._thread.start()
        if not ready.wait(self.config.start_timeout_s):
            raise TransferError(f"KV agent {self.name}: NIXL start timed out")
        if self._start_error is not None:
            raise TransferError(f"KV agent {self.name}: {self._start_error}") from self._start_error

    def submit(self, run: Callable[[], None], fail: Callable[[BaseException], None]) -> None:
        """Queue ``run`` for the thread; ``fail(err)`` instead if it will never run."""
        self._cmds.append((run, fail))
        self.wake()

    def wake(self) -> None:
        """End the thread's current wait now."""
        with contextlib.suppress(RuntimeError):  # already released: a wake is pending
            self._wake.release()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def cpu_s(self) -> float:
        """CPU seconds used so far by the thread (0.0 before start / after exit)."""
        thread = self._thread
        if thread is None or thread.ident is None or not thread.is_alive():
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except OSError:  # the thread ended in between
            return 0.0

    # -- commands (run on the thread, queued by the loop) ---------------------------------------

    def request_stop(self) -> None:
        """Stop taking commands; exit once in-flight writes finish (``close_timeout_s`` max)."""
        self._stop_at = time.monotonic() + self.config.close_timeout_s

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._nx.send_notif(peer, msg)

    def write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, notif: bytes, done: WriteDone
    ) -> None:
        """Post one WRITE of local pages ``src`` into the peer's ``dst``; ``done(err)`` once
        NIXL reports it finished (here if it finished at once)."""
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
            done(as_transfer_error(e))
            return
        try:
            state = self._nx.transfer(handle)  # a large room is copied right here (cma)
        except Exception as e:
            state = e
        if state == "PROC":
            self._inflight.append(_Xfer(peer, handle, done))
            return
        self._release(handle)
        done(None if state == "DONE" else as_transfer_error(state))

    def add_peer(self, name: str, metadata: bytes, desc: PoolDescriptor) -> None:
        """Load a peer's metadata, prepare its page descriptors and connect."""
        loaded = self._nx.add_remote_agent(metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            self._nx.remove_remote_agent(loaded)
            raise TransferError(f"metadata is for agent {loaded!r}, not {name!r}")
        try:
            self._peer_dls[name] = self._nx.prep_xfer_dlist(name, desc.page_descs(), desc.mem_type)
            self._nx.make_connection(name)  # connect now: the first room must not pay for it
        except Exception:
            self._forget(name)
            raise
        # NIXL 1.5.1 does not report which UCX transports (cuda_ipc, rc, tcp, cma) a connection
        # picked. UCX itself prints each endpoint's lanes at UCX_LOG_LEVEL=info ("ucp_worker.c
        # ... rma(...) am(...)" lines on stderr); here, what UCX was allowed to choose from.
        logger.info(
            "KV agent %s: connected to %s (%s -> %s; UCX_TLS=%s; UCX_LOG_LEVEL=info prints the "
            "transports UCX picked)",
            self.name, name, self.descriptor.mem_type, desc.mem_type, ucx_tls(),
        )  # fmt: skip

    def remove_peer(self, name: str) -> None:
        """Forget a peer; writes to it still in flight fail."""
        self._forget(name)
        self._poll_inflight()  # a write to a removed peer now reports an error: settle it
        for x in [x for x in self._inflight if x.peer == name]:
            self._inflight.remove(x)
            self._release(x.handle)
            x.done(TransferError(f"peer {name!r} was removed"))

    # -- the thread ------------------------------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        try:
            self._open()
        except Exception as e:
            logger.warning("KV agent %s: NIXL start failed: %s", self.name, e)
            self._start_error = e
            ready.set()
            self._shutdown()
            self._on_exit()
            return
        ready.set()
        try:
            self._serve()
        except Exception:
            logger.exception("KV agent %s: progress thread crashed", self.name)
        finally:
            self._shutdown()
            self._on_exit()

    def _open(self) -> None:
        cfg = self.config
        device = bind_cuda_device(self.pool.kv)  # before NIXL/UCX see the VRAM
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
        if device is not None:
            logger.info("KV agent %s: VRAM pool registered on cuda:%d", self.name, device)

    def _serve(self) -> None:
        cfg = self.config
        last_activity = time.monotonic()
        while True:
            self.num_polls += 1
            is_busy = self._drain_commands()
            is_busy |= self._poll_inflight()
            is_busy |= self._poll_notifs()
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
            elif quiet_s < cfg.warm_window_s or self.num_warm_holds > 0:
                wait_s = cfg.idle_wait_s
            else:
                wait_s = cfg.cold_wait_s
            self._wake.acquire(timeout=wait_s)

    def _drain_commands(self) -> bool:
        ran = False
        while self._cmds and self._stop_at is None:
            run, _fail = self._cmds.popleft()
            ran = True
            try:
                run()
            except Exception:
                logger.exception("KV agent %s: command failed", self.name)
        return ran

    def _poll_inflight(self) -> bool:
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
            self._release(x.handle)
            x.done(None if state == "DONE" else as_transfer_error(state))
        progressed = len(still) != len(self._inflight)
        self._inflight = still
        return progressed

    def _poll_notifs(self) -> bool:
        notifs = self._nx.get_new_notifs()  # also what keeps a receiving agent progressing
        if not notifs:
            return False
        self._to_loop(self._on_notifs, notifs)
        return True

    def _forget(self, name: str) -> None:
        try:
            self._nx.remove_remote_agent(name)
        except Exception as e:
            logger.debug("KV agent %s: remove_remote_agent(%s): %s", self.name, name, e)
        dl = self._peer_dls.pop(name, None)
        if dl is not None:
            self._release(dl)

    def _release(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception as e:  # an xfer NIXL cannot cancel yet: kept, retried at shutdown
            logger.debug("KV agent %s: release failed: %s", self.name, e)
            self._zombies.append(handle)

    def _shutdown(self) -> None:
        closed = TransferError(f"KV agent {self.name} closed")
        for x in self._inflight:
            self._release(x.handle)
            x.done(closed)
        self._inflight = []
        while self._cmds:
            _run, fail = self._cmds.popleft()
            fail(closed)
        if self._nx is None:
            return
        for name in list(self._peer_dls):
            self._forget(name)
        if self._local_dl is not None:
            self._release(self._local_dl)
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
