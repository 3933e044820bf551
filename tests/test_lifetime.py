"""Children of a supervisor end with it, even when it is SIGKILLed: the parent-death signal and
the child's own watch on its parent pid each do it alone."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.envs import env_with_pythonpath
from pdserve.lifetime import is_parent, wait_for_stop

EXIT_BOUND_S = 20.0

# The middle process (the "supervisor") starts one grandchild, prints its pid, then sleeps.
_MIDDLE = """
import os, subprocess, sys, time
from pdserve.lifetime import parent_death_preexec
how = sys.argv[1]
me = os.getpid()
if how == "pdeathsig":  # only the kernel's signal: the grandchild itself watches nothing
    argv = [sys.executable, "-c", "import time; time.sleep(600)"]
    child = subprocess.Popen(argv, preexec_fn=parent_death_preexec(me))
else:  # only the grandchild's watch on its parent pid
    code = (
        "import asyncio, sys; from pdserve.lifetime import wait_for_stop; "
        "asyncio.run(wait_for_stop(asyncio.Event(), int(sys.argv[1]), 0.05)); print('stopped')"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(me)])
print(child.pid, flush=True)
time.sleep(600)
"""


def is_running(pid: int) -> bool:
    """Alive and not a zombie (a re-parented child may wait a while to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running after ``timeout_s`` (polled with a deadline)."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if is_running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)  # poll of /proc with a deadline
    return alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl are Linux's")
@pytest.mark.parametrize("how", ["pdeathsig", "parent-watch"])
def test_a_grandchild_exits_when_its_supervisor_is_sigkilled(how: str) -> None:
    env = env_with_pythonpath(str(Path(__file__).resolve().parents[1]))
    middle = subprocess.Popen(
        [sys.executable, "-c", _MIDDLE, how], stdout=subprocess.PIPE, env=env,
        start_new_session=True,
    )  # fmt: skip
    grandchild = None
    try:
        assert middle.stdout is not None
        grandchild = int(middle.stdout.readline())
        assert is_running(grandchild)
        middle.kill()
        middle.wait(timeout=10)
        assert wait_gone([grandchild], EXIT_BOUND_S) == []
    finally:
        middle.kill()
        if grandchild is not None and is_running(grandchild):
            os.kill(grandchild, signal.SIGKILL)


async def test_wait_for_stop_returns_when_stopped_while_the_parent_lives() -> None:
    stop = asyncio.Event()
    assert is_parent(os.getppid())
    waiter = asyncio.create_task(wait_for_stop(stop, os.getppid(), interval_s=0.01))
    await asyncio.sleep(0.05)  # several watch intervals pass: the parent is alive, it waits on
    assert not waiter.done()
    stop.set()
    await asyncio.wait_for(waiter, 5)


async def test_wait_for_stop_sets_stop_once_the_given_pid_is_not_the_parent() -> None:
    stop = asyncio.Event()
    not_my_parent = os.getpid()
    await asyncio.wait_for(wait_for_stop(stop, not_my_parent, interval_s=0.01), 5)
    assert stop.is_set()


async def test_without_a_parent_pid_only_stop_ends_the_wait() -> None:
    stop = asyncio.Event()
    waiter = asyncio.create_task(wait_for_stop(stop, None))
    await asyncio.sleep(0)
    assert not waiter.done()
    stop.set()
    await asyncio.wait_for(waiter, 5)
