"""Room, RoomState, RoomSide, RoomDeadlines and RoomOutcome (pdserve/fsm/room.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import orjson
import pytest

from pdserve.fsm import (
    TERMINAL_STATES,
    Room,
    RoomDeadlines,
    RoomOutcome,
    RoomSide,
    RoomState,
)


def test_state_values_are_their_names() -> None:
    assert [s.value for s in RoomState] == [
        "Bootstrapping",
        "WaitingForInput",
        "Transferring",
        "Success",
        "Failed",
    ]
    assert RoomState("Transferring") is RoomState.TRANSFERRING
    assert RoomState.SUCCESS == "Success"  # str enum: compares equal to the machine's state names
    assert frozenset({"Success", "Failed"}) == TERMINAL_STATES


def test_side_values() -> None:
    assert RoomSide.SENDER.value == "sender"
    assert RoomSide.RECEIVER.value == "receiver"
    assert RoomSide("receiver") is RoomSide.RECEIVER


def test_deadlines_cover_every_live_state() -> None:
    deadlines = RoomDeadlines(bootstrapping_s=1.0, waiting_for_input_s=2.0, transferring_s=3.0)
    assert deadlines.by_state() == {
        "Bootstrapping": 1.0,
        "WaitingForInput": 2.0,
        "Transferring": 3.0,
    }
    assert RoomDeadlines().by_state() == {
        "Bootstrapping": 30.0,
        "WaitingForInput": 60.0,
        "Transferring": 30.0,
    }


@pytest.mark.parametrize("field", ["bootstrapping_s", "waiting_for_input_s", "transferring_s"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_deadlines_reject_non_positive(field: str, value: float) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        RoomDeadlines(**{field: value})


def test_deadlines_and_outcome_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        RoomDeadlines().transferring_s = 1.0  # type: ignore[misc]
    outcome = RoomOutcome("r", RoomState.FAILED, "aborted")
    with pytest.raises(dataclasses.FrozenInstanceError):
        outcome.reason = "other"  # type: ignore[misc]


async def test_room_is_slotted_and_starts_without_state() -> None:
    loop = asyncio.get_running_loop()
    room = Room("r1", RoomSide.SENDER, loop.create_future(), 10.0, page_ids=[1, 2])
    with pytest.raises(AttributeError):
        room.anything_else = 1  # type: ignore[attr-defined]
    # Only the machine writes ``state``; a bare Room has none until a table's machine sets it.
    with pytest.raises(AttributeError):
        _ = room.state
    assert room.page_ids == [1, 2]
    assert room.data == {}
    assert room.created_at == room.state_entered_at == 10.0
    assert "r1" in repr(room)


async def test_page_ids_default_to_a_fresh_list() -> None:
    loop = asyncio.get_running_loop()
    first = Room("a", RoomSide.SENDER, loop.create_future(), 0.0)
    second = Room("b", RoomSide.SENDER, loop.create_future(), 0.0)
    first.page_ids.append(7)
    assert second.page_ids == []


async def test_age_is_frozen_once_finished() -> None:
    loop = asyncio.get_running_loop()
    room = Room("r1", RoomSide.RECEIVER, loop.create_future(), 100.0)
    assert room.age_s(103.5) == pytest.approx(3.5)
    room.finished_at = 101.0
    assert room.age_s(500.0) == pytest.approx(1.0)


async def test_debug_dict_is_json_and_complete(make_table) -> None:
    table = make_table(RoomSide.RECEIVER, waiting_for_input_s=7.0)
    room = table.create("r1", request_id="req-1", peer="prefill-0@abc", page_ids=[3, 4, 5])
    table.fire("r1", "bootstrapped", "hello")
    info = room.debug_dict()
    decoded = orjson.loads(orjson.dumps(info))
    assert decoded["id"] == "r1"
    assert decoded["side"] == "receiver"
    assert decoded["state"] == "WaitingForInput"
    assert decoded["request_id"] == "req-1"
    assert decoded["peer"] == "prefill-0@abc"
    assert decoded["num_pages"] == 3
    assert decoded["last_transition"] == [
        "bootstrapped",
        "Bootstrapping",
        "WaitingForInput",
        "hello",
    ]
    assert decoded["reason"] is None
    assert 0.0 <= decoded["age_s"] < 5.0
    assert 6.0 < decoded["deadline_in_s"] <= 7.0
    assert room.is_terminal is False


async def test_is_terminal_after_finish(make_table) -> None:
    table = make_table()
    room = table.create("r1")
    table.fail("r1", "aborted")
    assert room.is_terminal is True
    info = room.debug_dict()
    assert info["state"] == "Failed"
    assert info["reason"] == "aborted"
    assert info["deadline_in_s"] is None
