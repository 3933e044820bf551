"""Regression: an abort landing between two chunk writes of a running transfer.

Seen in other PD systems: the transfer worker reports per chunk; an abort arrives mid-transfer;
the worker's late "chunk sent"/"done" then resurrected the room (or succeeded a new room that
reused the id). Here late triggers must be counted no-ops, the room ends Failed with the abort's
reason, its waiter is told, its pages are released once, and nothing stays armed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from pdserve.fsm import Room, RoomOutcome, RoomState, RoomTable

from .conftest import WAIT_S, wait_done

NUM_CHUNKS = 4
ABORT_AFTER_CHUNK = 1  # the abort lands after chunk 1 is reported, before chunk 2 is written


async def _write_chunk() -> None:
    # Like a NIXL completion: the transfer finishes elsewhere and is handed back via the loop.
    loop = asyncio.get_running_loop()
    written = loop.create_future()
    loop.call_soon(written.set_result, None)
    await written


async def _transfer_worker(
    report: Callable[[str], bool], paused: asyncio.Event, resume: asyncio.Event
) -> list[bool]:
    results = []
    for chunk in range(NUM_CHUNKS):
        await _write_chunk()
        results.append(report("chunk_sent"))
        if chunk == ABORT_AFTER_CHUNK:
            paused.set()
            await asyncio.wait_for(resume.wait(), WAIT_S)
    await _write_chunk()
    results.append(report("transfer_done"))
    return results


def _abort(table: RoomTable, room: Room, how: str) -> str:
    if how == "abort":
        assert table.fail(room.room_id, "aborted")
        return "aborted"
    if how == "peer_lost":
        assert table.fail_peer("decode-0@1", "peer_lost") == [room.room_id]
        return "peer_lost"
    assert table.expire(room.room_id)  # the Transferring deadline expiring mid-transfer
    return "timeout:Transferring"


def _transferring_room(table: RoomTable, room_id: str) -> Room:
    room = table.create(room_id, request_id="req-1", peer="decode-0@1", page_ids=[1, 2, 3])
    assert table.fire(room_id, "bootstrapped") and table.fire(room_id, "begin_transfer")
    return room


@pytest.mark.parametrize("how", ["abort", "peer_lost", "timeout"])
async def test_abort_between_chunks_makes_late_reports_noops(make_table, release_log, how: str):
    table = make_table()
    room = _transferring_room(table, "room-1")
    paused, resume = asyncio.Event(), asyncio.Event()
    waiter = asyncio.create_task(wait_done(room))
    worker = asyncio.create_task(
        _transfer_worker(lambda t: table.fire("room-1", t), paused, resume)
    )
    await asyncio.wait_for(paused.wait(), WAIT_S)
    reason = _abort(table, room, how)
    resume.set()

    results = await asyncio.wait_for(worker, WAIT_S)
    outcome = await asyncio.wait_for(waiter, WAIT_S)
    assert results == [True, True, False, False, False]
    assert outcome == RoomOutcome("room-1", RoomState.FAILED, reason)
    assert room.state == "Failed" and room.num_chunks == ABORT_AFTER_CHUNK + 1
    assert release_log.count(room) == 1
    assert table.stats.rejected == {("chunk_sent", "Gone"): 2, ("transfer_done", "Gone"): 1}
    assert table.stats.succeeded == 0 and table.stats.failed == 1
    assert len(table) == 0 and len(table.deadline_queues) == 0 and room.deadline_at is None


async def test_late_reports_cannot_touch_a_room_reusing_the_id(make_table, release_log) -> None:
    table = make_table()
    old = _transferring_room(table, "room-1")
    paused, resume = asyncio.Event(), asyncio.Event()
    worker = asyncio.create_task(
        _transfer_worker(lambda t: table.fire_room(old, t), paused, resume)
    )
    await asyncio.wait_for(paused.wait(), WAIT_S)
    assert table.fail("room-1", "aborted")
    new = _transferring_room(table, "room-1")  # the request is retried under the same room id
    resume.set()

    assert await asyncio.wait_for(worker, WAIT_S) == [True, True, False, False, False]
    assert (await wait_done(old)).reason == "aborted"
    assert new.state == "Transferring" and new.num_chunks == 0 and not new.done.done()
    assert release_log.rooms == [old]
    assert len(table.deadline_queues) == 1 and table.deadline_queues.is_armed(new)
    table.close()
    assert (await wait_done(new)).reason == "shutdown"
    assert len(table.deadline_queues) == 0 and table.deadline_queues.next_wakeup_at is None
