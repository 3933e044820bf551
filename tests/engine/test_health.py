"""EngineHealth: a failed step fails its batch at TP1, and ends the engine once it has
tensor-parallel ranks (every request failed with the cause, later ones refused, listeners told
once); a rank that exits while the engine idles is seen through its pidfd on the event loop.
Fakes stand in for the runner and its ranks; the exiting process is a real one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any, cast

import pytest

from pdserve.engine.health import EngineHealth
from pdserve.engine.protocol import EngineError
from pdserve.engine.request import Request
from pdserve.model_runner import ModelRunner
from pdserve.parallel.ranks import RankDied

DEATH = "tensor-parallel rank 1 exited (status -9)"


class FakeRanks:
    def __init__(self, exit_fds: list[int] | None = None, dead: bool = True) -> None:
        self.exit_fds = exit_fds or []
        self.dead = dead

    def wait_dead(self, timeout_s: float) -> RankDied | None:
        return RankDied(DEATH) if self.dead else None


class FakeRunner:
    def __init__(self, ranks: FakeRanks | None) -> None:
        self._ranks = ranks
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


class Table:
    """The engine's request table and fail(), as the health sees them."""

    def __init__(self, *ids: str) -> None:
        self.requests: dict[str, Any] = {i: i for i in ids}
        self.failed: dict[str, EngineError] = {}

    def fail(self, req: Any, error: EngineError) -> None:
        self.failed[req] = error
        self.requests.pop(req, None)


def _health(ranks: FakeRanks | None, table: Table) -> tuple[EngineHealth, FakeRunner]:
    runner = FakeRunner(ranks)
    requests = cast(dict[str, Request], table.requests)
    return EngineHealth(cast(ModelRunner, runner), requests, table.fail), runner


def _reqs(*ids: str) -> list[Request]:
    return cast(list[Request], list(ids))


async def test_at_tp1_a_failed_step_fails_its_batch_and_the_engine_serves_on() -> None:
    table = Table("a", "b", "c")
    health, _ = _health(None, table)
    await health.step_failed("decode", _reqs("a", "b"), ValueError("bad row"))
    assert set(table.failed) == {"a", "b"} and "c" in table.requests
    assert table.failed["a"].message == "model step failed: bad row"
    assert health.error is None and health.refusal().message == "engine is not ready"


async def test_with_ranks_a_failed_step_ends_the_engine_naming_the_dead_rank() -> None:
    table = Table("a", "b", "c")
    health, _ = _health(FakeRanks(), table)
    told: list[EngineError] = []
    health.on_fatal(told.append)
    await health.step_failed("decode", _reqs("a"), RuntimeError("Connection reset by peer"))
    assert set(table.failed) == {"a", "b", "c"}  # the whole engine, not just the batch
    error = table.failed["c"]
    assert (error.status, error.code) == (500, "engine_failed")
    assert error.message == f"engine failed: {DEATH}"
    assert told == [health.error] and health.error is not None
    assert (health.error.status, health.refusal()) == (503, health.error)
    await health.step_failed("decode", _reqs("d"), RuntimeError("again"))
    assert len(told) == 1  # told once
    late: list[EngineError] = []
    health.on_fatal(late.append)
    assert late == [health.error]  # a listener that comes late hears it at once


async def test_with_ranks_alive_a_failed_step_still_ends_the_engine_with_its_error() -> None:
    # The other ranks may have run part of the step: their collectives no longer meet rank 0's.
    table = Table("a")
    health, _ = _health(FakeRanks(dead=False), table)
    await health.step_failed("prefill", _reqs("a"), RuntimeError("gather timed out"))
    assert table.failed["a"].message == "engine failed: gather timed out"


@pytest.fixture
def child() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A process that exits when its stdin closes, and its pidfd (a rank stand-in)."""
    if not hasattr(os, "pidfd_open"):
        pytest.skip("pidfds are Linux 5.3+")
    argv = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE)
    fd = os.pidfd_open(proc.pid)
    try:
        yield proc, fd
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=30)
        os.close(fd)


async def test_a_rank_that_exits_while_idle_ends_the_engine_and_close_ends_the_runner(
    child: tuple[subprocess.Popen[bytes], int],
) -> None:
    proc, fd = child
    table = Table("a")
    health, runner = _health(FakeRanks([fd]), table)
    ended = asyncio.Event()
    health.on_fatal(lambda _error: ended.set())
    health.start()
    assert proc.stdin is not None
    proc.stdin.close()  # the "rank" exits
    await asyncio.wait_for(ended.wait(), 30)
    assert table.failed["a"].message == f"engine failed: {DEATH}"
    await health.close()
    assert runner.closed == 1
