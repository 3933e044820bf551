"""RunnerThread: calls run in order on one thread; results and errors come back on the loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.engine.runner_thread import RunnerThread


async def test_calls_run_in_order_on_one_other_thread() -> None:
    worker = RunnerThread()
    seen: list[tuple[int, str]] = []

    def record(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * i

    try:
        futs = [worker.submit(record, i) for i in range(5)]
        results = await asyncio.wait_for(asyncio.gather(*futs), 10)
    finally:
        await worker.stop()
    assert results == [0, 1, 4, 9, 16]
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    names = {name for _, name in seen}
    assert len(names) == 1 and threading.current_thread().name not in names


async def test_an_exception_in_the_call_reaches_the_awaiting_coroutine() -> None:
    worker = RunnerThread()

    def boom(_: object) -> None:
        raise ValueError("bad batch")

    try:
        with pytest.raises(ValueError, match="bad batch"):
            await asyncio.wait_for(worker.submit(boom, None), 10)
        assert await asyncio.wait_for(worker.submit(abs, -3), 10) == 3  # still serving
    finally:
        await worker.stop()


async def test_stop_finishes_queued_calls_then_refuses_new_ones() -> None:
    worker = RunnerThread()
    gate = threading.Event()
    first = worker.submit(lambda _: gate.wait(10), None)
    second = worker.submit(abs, -5)
    gate.set()
    await worker.stop()
    assert first.done() or await asyncio.wait_for(first, 10)
    assert await asyncio.wait_for(second, 10) == 5
    with pytest.raises(RuntimeError):
        worker.submit(abs, 1)
