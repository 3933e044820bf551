"""An exclusive ``flock`` on a file, waited for with a deadline.

The kernel drops an flock when its holder's file is closed, the holder's process included, so
a killed holder never blocks the next one. Used where processes on one machine take turns: the
C++ kernels' build (pdserve.kernels.cpu_ext) and the KV pool sizing of workers sharing a GPU
(pdserve.kv_sizing).
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from pathlib import Path

POLL_S = 0.2  # the poll interval of a bounded wait, not synchronisation by sleep


@contextlib.contextmanager
def exclusive_file_lock(lock_path: Path, timeout_s: float) -> Iterator[None]:
    """An flock on ``lock_path``, polled until ``timeout_s`` (then TimeoutError)."""
    deadline = time.monotonic() + timeout_s
    with open(lock_path, "a") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{lock_path} held for {timeout_s} s") from None
                time.sleep(POLL_S)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
