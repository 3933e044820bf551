"""RoomTable: transitions, no-ops, release, deadlines, peers, shutdown (pdserve/fsm/table.py)."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from pdserve.fsm import (
    TRIGGERS,
    DuplicateRoomError,
    RoomDeadlines,
    RoomOutcome,
    RoomSide,
    RoomState,
    RoomTable,
)
from pdserve.fsm.table import MAX_RECENT, UNKNOWN_TRIGGER

from .conftest import wait_done

# Triggers that take a fresh room to each live state.
PATH_TO = {
    "Bootstrapping": [],
    "WaitingForInput": ["bootstrapped"],
    "Transferring": ["bootstrapped", "begin_transfer"],
}
DEADLINE_FIELD = {
    "Bootstrapping": "bootstrapping_s",
    "WaitingForInput": "waiting_for_input_s",
    "Transferring": "transferring_s",
}
VALID = {
    "Bootstrapping": {"bootstrapped", "fail"},
    "WaitingForInput": {"begin_transfer", "fail"},
    "Transferring": {"chunk_sent", "transfer_done", "fail"},
}


def _room_in(table: RoomTable, room_id: str, state: str):
    room = table.create(room_id, request_id=f"req-{room_id}")
    for trigger in PATH_TO[state]:
        assert table.fire(room_id, trigger)
    assert room.state == state
    return room


@pytest.mark.parametrize("side", list(RoomSide))
async def test_success_path(make_table, release_log, side: RoomSide) -> None:
    table = make_table(side)
    room = table.create("r1", request_id="req-1", page_ids=[4, 5])
    assert room.state == "Bootstrapping" and "r1" in table and len(table) == 1
    for trigger, state in [
        ("bootstrapped", "WaitingForInput"),
        ("begin_transfer", "Transferring"),
        ("chunk_sent", "Transferring"),
        ("chunk_sent", "Transferring"),
    ]:
        assert table.fire("r1", trigger) is True
        assert room.state == state
    assert room.num_chunks == 2
    assert table.fire("r1", "transfer_done") is True
    assert await wait_done(room) == RoomOutcome("r1", RoomState.SUCCESS, None)
    assert room.state == "Success" and room.reason is None
    assert "r1" not in table and table.get("r1") is None and len(table) == 0
    assert release_log.rooms == [room]
    assert table.stats.created == 1 and table.stats.succeeded == 1 and table.stats.failed == 0
    assert table.stats.transitions == 5
    assert room.last_transition == ("transfer_done", "Transferring", "Success", None)


@pytest.mark.parametrize("state", list(PATH_TO))
async def test_fail_from_each_live_state(make_table, release_log, state: str) -> None:
    table = make_table()
    room = _room_in(table, "r1", state)
    assert table.fail("r1", "transfer_error: UCX boom") is True
    outcome = await wait_done(room)
    assert outcome == RoomOutcome("r1", RoomState.FAILED, "transfer_error: UCX boom")
    assert room.last_transition == ("fail", state, "Failed", "transfer_error: UCX boom")
    assert table.stats.failed_by_reason == {"transfer_error": 1}
    assert release_log.count(room) == 1
    assert room.deadline_at is None


@pytest.mark.parametrize("state", list(PATH_TO))
async def test_invalid_triggers_are_counted_noops(make_table, release_log, state: str) -> None:
    table = make_table()
    room = _room_in(table, "r1", state)
    before = (room.state, room.deadline_at, room.last_transition, room.num_chunks)
    invalid = [t for t in TRIGGERS if t not in VALID[state]] + ["to_Success", "bogus"]
    for trigger in invalid:
        assert table.fire("r1", trigger, "late") is False
    assert (room.state, room.deadline_at, room.last_transition, room.num_chunks) == before
    assert not room.done.done() and release_log.rooms == []
    for trigger in invalid:
        key = (trigger if trigger in TRIGGERS else UNKNOWN_TRIGGER, state)
        assert table.stats.rejected[key] >= 1
    assert table.stats.num_rejected == len(invalid)


async def test_unknown_room_id_is_gone_noop(make_table) -> None:
    table = make_table()
    for trigger in TRIGGERS:
        assert table.fire("nope", trigger, "x") is False
    assert table.fail("nope", "aborted") is False
    assert table.expire("nope") is False
    assert table.stats.rejected[("fail", "Gone")] == 3
    assert table.stats.rejected[("chunk_sent", "Gone")] == 1
    assert table.stats.failed == 0


async def test_no_auto_transitions_on_rooms(make_table) -> None:
    table = make_table()
    room = table.create("r1")
    for state in RoomState:
        assert not hasattr(room, f"to_{state.value}")
        assert not hasattr(table, f"to_{state.value}")
        assert table.fire("r1", f"to_{state.value}") is False
    assert not hasattr(room, "bootstrapped")  # triggers live on the shared machine only
    assert room.state == "Bootstrapping"


@pytest.mark.parametrize("final", ["transfer_done", "fail"])
async def test_terminal_states_absorb_everything(make_table, release_log, final: str) -> None:
    table = make_table()
    room = _room_in(table, "r1", "Transferring")
    assert table.fire("r1", final, "aborted" if final == "fail" else None)
    outcome = await wait_done(room)
    for trigger in [*TRIGGERS, "to_Bootstrapping"]:
        assert table.fire("r1", trigger, "late") is False
    assert table.fail("r1", "peer_lost") is False
    assert table.expire("r1") is False
    assert table.fail_peer("any", "peer_lost") == []
    table.close()
    assert room.done.result() is outcome and room.state == outcome.state.value
    assert release_log.count(room) == 1
    assert table.stats.succeeded + table.stats.failed == 1


async def test_duplicate_live_id_rejected_and_reusable_after_finish(make_table, release_log):
    table = make_table()
    first = table.create("r1", page_ids=[1])
    with pytest.raises(DuplicateRoomError, match="r1"):
        table.create("r1", page_ids=[2])
    assert table.get("r1") is first and first.page_ids == [1]
    assert table.fail("r1", "aborted")
    second = table.create("r1", page_ids=[2])
    assert second is not first and second.done is not first.done
    assert second.state == "Bootstrapping" and not second.done.done()
    assert table.fire("r1", "bootstrapped") and first.state == "Failed"
    assert release_log.count(first) == 1 and release_log.count(second) == 0
    assert table.stats.created == 2


@pytest.mark.parametrize("state", list(PATH_TO))
async def test_deadline_fires_timeout_per_state(make_table, release_log, state: str) -> None:
    # Only the state under test has a tiny deadline, so the timeout can only come from it.
    deadlines = {"bootstrapping_s": 60.0, "waiting_for_input_s": 60.0, "transferring_s": 60.0}
    deadlines[DEADLINE_FIELD[state]] = 0.01
    table = make_table(**deadlines)
    room = _room_in(table, "r1", state)
    outcome = await wait_done(room)
    assert outcome == RoomOutcome("r1", RoomState.FAILED, f"timeout:{state}")
    assert table.stats.timeouts_by_state == {state: 1}
    assert table.stats.failed_by_reason == {f"timeout:{state}": 1}
    assert release_log.count(room) == 1 and len(table) == 0


async def test_leaving_a_state_cancels_its_deadline(make_table) -> None:
    table = make_table(bootstrapping_s=0.02, waiting_for_input_s=60.0)
    moved = table.create("moved")
    assert table.fire("moved", "bootstrapped")
    assert moved.deadline_at == pytest.approx(moved.state_entered_at + 60.0)
    assert len(table.deadline_queues) == 1 and table.deadline_queues.is_armed(moved)
    # A later room with the same deadline is our clock: when it times out, the first room's
    # Bootstrapping deadline (earlier) has passed too, had it still been armed.
    probe = table.create("probe")
    assert (await wait_done(probe)).reason == "timeout:Bootstrapping"
    assert moved.state == "WaitingForInput" and not moved.done.done()
    assert table.stats.timeouts_by_state == {"Bootstrapping": 1}


async def test_chunk_sent_does_not_rearm_deadline(make_table) -> None:
    table = make_table(transferring_s=0.05)
    room = _room_in(table, "r1", "Transferring")
    deadline_at = room.deadline_at
    assert table.fire("r1", "chunk_sent") and table.fire("r1", "chunk_sent")
    assert room.deadline_at == deadline_at and len(table.deadline_queues) == 1
    assert (await wait_done(room)).reason == "timeout:Transferring"


@pytest.mark.parametrize("final", ["transfer_done", "fail"])
async def test_finishing_disarms_deadline(make_table, final: str) -> None:
    table = make_table()
    room = _room_in(table, "r1", "Transferring")
    assert table.deadline_queues.is_armed(room)
    assert table.fire("r1", final, "aborted")
    assert not table.deadline_queues.is_armed(room) and room.deadline_at is None
    assert len(table.deadline_queues) == 0


async def test_fail_peer_fails_only_that_peers_rooms(make_table, release_log) -> None:
    table = make_table()
    table.create("a1", peer="decode-0@1")
    table.create("a2")
    table.bind_peer("a2", "decode-0@1")
    _room_in(table, "a3", "Transferring").peer = None
    table.bind_peer("a3", "decode-0@1")
    table.create("b1", peer="decode-1@1")
    table.bind_peer("gone", "decode-0@1")  # unknown id: ignored, no room created
    failed = table.fail_peer("decode-0@1", "peer_lost")
    assert sorted(failed) == ["a1", "a2", "a3"]
    assert [r.room_id for r in table.rooms()] == ["b1"]
    assert table.stats.failed_by_reason == {"peer_lost": 3}
    assert sorted(r.room_id for r in release_log.rooms) == ["a1", "a2", "a3"]
    assert table.fail_peer("decode-0@1", "peer_lost") == []


async def test_close_fails_every_live_room(make_table, release_log) -> None:
    table = make_table()
    rooms = [_room_in(table, f"r{i}", state) for i, state in enumerate(PATH_TO)]
    assert len(table.deadline_queues) == 3 and table.deadline_queues.next_wakeup_at is not None
    table.close()
    outcomes = await asyncio.wait_for(asyncio.gather(*(r.done for r in rooms)), 5.0)
    assert {o.reason for o in outcomes} == {"shutdown"}
    assert {o.state for o in outcomes} == {RoomState.FAILED}
    assert len(table.deadline_queues) == 0 and table.deadline_queues.next_wakeup_at is None
    assert len(table) == 0 and len(release_log.rooms) == 3
    table.close("again")  # idempotent on an empty table
    assert table.stats.failed == 3


async def test_counts_and_oldest_ages(make_table) -> None:
    table = make_table()
    assert table.count_by_state() == {"Bootstrapping": 0, "WaitingForInput": 0, "Transferring": 0}
    assert table.oldest_age_by_state() == {
        "Bootstrapping": 0.0,
        "WaitingForInput": 0.0,
        "Transferring": 0.0,
    }
    old = _room_in(table, "old", "Transferring")
    _room_in(table, "new", "Transferring")
    _room_in(table, "w", "WaitingForInput")
    assert table.count_by_state() == {"Bootstrapping": 0, "WaitingForInput": 1, "Transferring": 2}
    ages = table.oldest_age_by_state(now=old.created_at + 10.0)
    assert ages["Transferring"] == pytest.approx(10.0)
    assert 0.0 < ages["WaitingForInput"] <= 10.0 and ages["Bootstrapping"] == 0.0


async def test_debug_and_recent(make_table) -> None:
    table = make_table()
    _room_in(table, "live", "WaitingForInput")
    live = orjson.loads(orjson.dumps(table.debug()))
    assert [d["id"] for d in live] == ["live"] and live[0]["state"] == "WaitingForInput"
    for i in range(MAX_RECENT + 10):
        table.create(f"f{i}")
        table.fail(f"f{i}", "aborted")
    recent = orjson.loads(orjson.dumps(table.recent()))
    assert len(recent) == MAX_RECENT
    assert recent[-1]["id"] == f"f{MAX_RECENT + 9}" and recent[0]["id"] == "f10"
    assert recent[-1]["reason"] == "aborted" and recent[-1]["deadline_in_s"] is None


async def test_release_error_is_logged_not_raised(caplog) -> None:
    def broken(room) -> None:
        raise RuntimeError("pool gone")

    table = RoomTable(RoomSide.SENDER, on_release=broken)
    room = table.create("r1")
    with caplog.at_level(logging.ERROR, logger="pdserve.fsm.table"):
        assert table.fail("r1", "aborted") is True
    assert (await wait_done(room)).reason == "aborted"
    assert table.stats.release_errors == 1
    assert "on_release failed" in caplog.text and "pool gone" in caplog.text


async def test_cancelled_waiter_does_not_break_finish(make_table, release_log) -> None:
    table = make_table()
    room = table.create("r1")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(room.done, 0.001)  # bare wait_for cancels room.done
    assert table.fail("r1", "aborted") is True
    assert room.state == "Failed" and release_log.count(room) == 1


async def test_fail_without_reason_records_unspecified(make_table) -> None:
    table = make_table()
    room = table.create("r1")
    assert table.fire("r1", "fail") is True
    assert (await wait_done(room)).reason == "unspecified"


async def test_transitions_are_logged(make_table, caplog) -> None:
    table = make_table(RoomSide.RECEIVER)
    with caplog.at_level(logging.DEBUG, logger="pdserve.fsm.table"):
        table.create("r9", request_id="req-9")
        table.fire("r9", "bootstrapped")
        table.fire("r9", "transfer_done")  # invalid here
        table.fail("r9", "aborted")
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "pdserve.fsm.table"]
    assert (
        logging.DEBUG,
        "room=r9 req=req-9 side=receiver Bootstrapping -> WaitingForInput "
        "trigger=bootstrapped reason=None",
    ) in lines
    assert (
        logging.INFO,
        "room=r9 req=req-9 side=receiver WaitingForInput -> Failed trigger=fail reason=aborted",
    ) in lines
    assert any("trigger=transfer_done rejected in state=WaitingForInput" in m for _, m in lines)
    # The library's own per-trigger chatter stays out of the service log.
    assert not [r for r in caplog.records if r.name.startswith("transitions")]


def test_table_binds_explicit_loop_outside_running_loop() -> None:
    loop = asyncio.new_event_loop()
    try:
        table = RoomTable(RoomSide.SENDER, RoomDeadlines(bootstrapping_s=0.01), loop=loop)

        async def scenario() -> RoomOutcome:
            return await wait_done(table.create("r1"))

        assert loop.run_until_complete(scenario()).reason == "timeout:Bootstrapping"
    finally:
        loop.close()


async def test_stock_machine_table_behaves_the_same(release_log) -> None:
    table = RoomTable(RoomSide.SENDER, on_release=release_log, lean_machine=False)
    assert type(table.machine).__name__ == "Machine"
    ok = _room_in(table, "ok", "Transferring")
    assert table.fire("ok", "bootstrapped") is False
    assert table.fire("ok", "chunk_sent") and table.fire("ok", "transfer_done")
    bad = _room_in(table, "bad", "WaitingForInput")
    assert table.fail("bad", "aborted")
    assert (await wait_done(ok)).state is RoomState.SUCCESS
    assert (await wait_done(bad)).reason == "aborted"
    assert release_log.rooms == [ok, bad] and ok.num_chunks == 1
    assert table.stats.rejected == {("bootstrapped", "Transferring"): 1}
