"""Child processes that end with their supervisor (``pdserve up``), even when it is SIGKILLed.

Two mechanisms, because either alone has a gap: Linux's parent-death signal (set between fork
and exec: the kernel sends SIGTERM to the child when the parent dies; Linux only, and lost if the
parent died before it was set) and a watch in the child on its parent pid (``--parent-pid``), which
notices within a second that the child was re-parented.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_POLL_INTERVAL_S = 0.5


def parent_death_preexec(parent_pid: int, sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``subprocess.Popen(preexec_fn=...)`` that makes the child get ``sig`` when
    ``parent_pid`` (the process calling Popen, single-threaded) dies."""
    prctl = _prctl()  # looked up here, in the parent: no dlopen between fork and exec

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before the signal was armed
            os._exit(1)

    return preexec


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def is_parent(pid: int) -> bool:
    """True while ``pid`` is still this process's parent (a dead parent's children are
    re-parented to init or a subreaper, so a recycled pid cannot fool this)."""
    return os.getppid() == pid


def add_parent_pid_arg(p: argparse.ArgumentParser) -> None:
    """``--parent-pid``: the flag a supervisor gives its children (serve and router)."""
    p.add_argument(
        "--parent-pid", type=int, default=None, metavar="PID",
        help="stop when process PID is no longer this one's parent (pdserve up sets it)",
    )  # fmt: skip


async def wait_for_stop(
    stop: asyncio.Event, parent_pid: int | None, interval_s: float = PARENT_POLL_INTERVAL_S
) -> None:
    """Wait until ``stop`` is set or, with ``parent_pid``, that process is no longer this one's
    parent (then ``stop`` is set too)."""
    while parent_pid is not None and is_parent(parent_pid):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
            return
    if parent_pid is not None and not stop.is_set():
        logger.warning("parent process %d is gone: stopping", parent_pid)
        stop.set()
    await stop.wait()
