"""Workers that share cores take turns through a file lock: exclusive, handed over at once,
bounded waits, and free again once a step ends however it ends."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.engine.cpu_lease import CpuLease
from pdserve.engine.runner_thread import RunnerThread


def _wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)  # polling a condition with a deadline


def _is_free(path: Path) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops the probe's own lock
    return True


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "cpu-lease"


def test_a_free_lease_is_taken_at_once_and_excludes_others(path: Path) -> None:
    lease = CpuLease(str(path))
    try:
        assert lease.acquire()
        assert not _is_free(path)
        lease.release()
        assert _is_free(path)
        assert (lease.stats.acquired, lease.stats.contended, lease.stats.timeouts) == (1, 0, 0)
    finally:
        lease.close()


def test_a_waiting_worker_gets_the_lease_when_the_holder_releases_it(path: Path) -> None:
    holder, waiter = CpuLease(str(path)), CpuLease(str(path))
    try:
        assert holder.acquire()
        got: list[bool] = []
        t = threading.Thread(target=lambda: got.append(waiter.acquire()))
        t.start()
        _wait_until(lambda: waiter.stats.contended == 1)  # it found the lease held
        assert not got
        holder.release()
        t.join(timeout=10)
        assert got == [True]
        assert not _is_free(path)
        waiter.release()
        assert _is_free(path)
        assert waiter.stats.wait_seconds > 0 and waiter.stats.timeouts == 0
    finally:
        holder.close()
        waiter.close()


def test_a_wait_is_bounded_and_an_abandoned_wait_never_keeps_the_lock(path: Path) -> None:
    holder, waiter = CpuLease(str(path)), CpuLease(str(path), timeout_s=0.05)
    try:
        assert holder.acquire()
        assert not waiter.acquire()  # ran without it after the timeout
        assert waiter.stats.timeouts == 1
        holder.release()
        # The waiter thread takes the lock late, sees its wait was given up, and unlocks.
        _wait_until(lambda: _is_free(path))
        assert waiter.acquire()
        waiter.release()
    finally:
        holder.close()
        waiter.close()


async def test_runner_steps_hold_the_lease_and_free_it_even_when_they_fail(path: Path) -> None:
    thread = RunnerThread(lease=CpuLease(str(path)))

    def fail(_: object) -> None:
        assert not _is_free(path)
        raise RuntimeError("model step failed")

    try:
        assert await thread.submit(lambda _: _is_free(path), None) is False
        with pytest.raises(RuntimeError, match="model step failed"):
            await thread.submit(fail, None)
        assert _is_free(path)
    finally:
        await thread.stop()
