"""Turns at the cores for workers that share one machine (``pdserve up``'s prefill and decode).

Every model step runs on all of its worker's torch threads. When a prefill step and a decode
step overlap on the same cores, the two workers' threads outnumber the cores, and each parallel
region of either waits at its barrier for a thread the OS has descheduled. On the 2-core test
machine that made prefill 2-3x slower than alone, so PD had to give prefill half the cores.
Workers given the same lease file instead take turns: a step runs while its worker holds an
exclusive ``flock`` on the file, with all its threads ("small", concurrency 8: 145-164 tok/s
with half the cores for prefill, 205 with the lease).

The kernel drops a dead process's lock, so a crashed peer never blocks the others, and a wait
is bounded: after ``timeout_s`` the step runs anyway (counted and logged), because the lease
only trades speed, never correctness. Waits block in the kernel (on a helper thread, so that
they can time out), and a released lock wakes its waiter at once: no polling.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TIMEOUT_S = 10.0


@dataclass
class LeaseStats:
    acquired: int = 0  # steps that ran holding the lease
    contended: int = 0  # acquisitions that found a peer holding it (and waited)
    wait_seconds: float = 0.0
    timeouts: int = 0  # steps that ran without it after timeout_s


class _Wait:
    """One blocking acquisition handed to the waiter thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.granted = threading.Event()
        self.is_abandoned = False


class CpuLease:
    """An exclusive, crash-safe lock on ``path`` shared with the other workers of the host.

    Used by one thread (the runner thread): ``acquire()`` before a step, ``release()`` after.
    """

    def __init__(self, path: str, timeout_s: float = DEFAULT_LEASE_TIMEOUT_S) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.stats = LeaseStats()
        # Two open file descriptions: flock conflicts between them even within one process, so
        # an abandoned wait that succeeds late can never unlock a lock taken on the fast path.
        self._fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        self._wait_fd = os.open(path, os.O_RDWR)
        self._held_fd: int | None = None
        self._waits: queue.SimpleQueue[_Wait | None] = queue.SimpleQueue()
        self._waiter = threading.Thread(target=self._wait_loop, name="pdserve-lease", daemon=True)
        self._waiter.start()

    def acquire(self) -> bool:
        """Take the lease; False when it stayed busy for ``timeout_s`` (run without it)."""
        assert self._held_fd is None, "acquire() twice without release()"
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return self._acquire_waiting()
        self._held_fd = self._fd
        self.stats.acquired += 1
        return True

    def release(self) -> None:
        if self._held_fd is not None:
            fcntl.flock(self._held_fd, fcntl.LOCK_UN)
            self._held_fd = None

    def close(self) -> None:
        self.release()
        self._waits.put(None)
        self._waiter.join(timeout=self.timeout_s)
        for fd in (self._fd, self._wait_fd):
            os.close(fd)

    def _acquire_waiting(self) -> bool:
        start = time.perf_counter()
        self.stats.contended += 1
        wait = _Wait()
        self._waits.put(wait)
        is_granted = wait.granted.wait(self.timeout_s)
        with wait.lock:
            if not is_granted and not wait.granted.is_set():
                wait.is_abandoned = True  # the waiter thread unlocks it when it comes
        waited = time.perf_counter() - start
        self.stats.wait_seconds += waited
        if wait.is_abandoned:
            self.stats.timeouts += 1
            logger.warning("CPU lease %s busy for %.1fs: running this step without it",
                           self.path, waited)  # fmt: skip
            return False
        self._held_fd = self._wait_fd
        self.stats.acquired += 1
        return True

    def _wait_loop(self) -> None:
        while (wait := self._waits.get()) is not None:
            fcntl.flock(self._wait_fd, fcntl.LOCK_EX)  # blocks in the kernel until it is ours
            with wait.lock:
                if wait.is_abandoned:
                    fcntl.flock(self._wait_fd, fcntl.LOCK_UN)
                else:
                    wait.granted.set()
