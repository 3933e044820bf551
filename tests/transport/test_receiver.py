"""KVReceiver (in one process, real NIXL): hand-shake, checks before Success, and the fence."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.fsm import DuplicateRoomError, RoomDeadlines, RoomState
from pdserve.transport.faults import FaultPlan
from pdserve.transport.messages import DataNotifMsg
from pdserve.transport.nixl_agent import KVAgent
from pdserve.transport.wire import encode
from tests.transport.conftest import Endpoints, fill, make_pool, outcome, pages_equal, until
from tests.transport.procs import free_port

LOCAL = "127.0.0.1"
SLOW = FaultPlan(delay_s=0.3)  # each chunk waits inside the write window: a wide mid-transfer


async def test_dead_bootstrap_address_fails_fast_with_bootstrap_error(endpoints: Endpoints) -> None:
    receiver, rel = await endpoints.receiver(connect_timeout_s=0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    room = await receiver.open_room("r", "req", LOCAL, free_port(), [1, 2], 20)
    out = await outcome(room, within_s=3.0)
    elapsed = loop.time() - started
    assert out.state == RoomState.FAILED and out.reason.startswith("bootstrap_error")
    assert "refused" in out.reason
    assert 0.3 <= elapsed < 1.5  # ~connect_timeout_s, not the 2 s Bootstrapping deadline
    assert rel.of("r") == [[1, 2]]  # nothing was posted: released at once


async def test_prefill_that_starts_later_is_found_by_registration_retries(
    endpoints: Endpoints,
) -> None:
    port = free_port()
    receiver, _ = await endpoints.receiver(connect_timeout_s=1.5)
    room = await receiver.open_room("late", "req", LOCAL, port, [3], 10)
    await until(lambda: receiver.stats["register_retries"] >= 1, what="a refused attempt")
    sender, _ = await endpoints.sender(bootstrap_port=port)
    sender.open_room("late", "req")
    fill(sender.pool, [0], seed=1)
    assert sender.send("late", [0], 10, first_token=5)
    assert (await outcome(room)).state == RoomState.SUCCESS
    assert pages_equal(sender.pool, [0], receiver.pool, [3])


async def test_duplicate_live_room_and_bad_pages_are_rejected_before_any_room_exists(
    endpoints: Endpoints,
) -> None:
    sender, _ = await endpoints.sender()
    receiver, rel = await endpoints.receiver()
    room = await receiver.open_room("d", "req", LOCAL, sender.bootstrap_port, [1], 10)
    with pytest.raises(DuplicateRoomError):
        await receiver.open_room("d", "req2", LOCAL, sender.bootstrap_port, [2], 10)
    with pytest.raises(ValueError, match="distinct"):
        await receiver.open_room("e", "req", LOCAL, sender.bootstrap_port, [1, 1], 10)
    with pytest.raises(ValueError, match="distinct"):
        await receiver.open_room("e", "req", LOCAL, sender.bootstrap_port, [64], 10)
    assert receiver.table.get("d") is room and "e" not in receiver.table
    assert rel.calls == []


async def test_checksum_mismatch_fails_the_room(endpoints: Endpoints) -> None:
    sender, _ = await endpoints.sender(checksum=True, max_chunk_pages=1, faults=SLOW)
    receiver, rel = await endpoints.receiver(checksum=True)
    src = [0, 1]
    fill(sender.pool, src, seed=2)
    sender.open_room("c", "req")
    room = await receiver.open_room("c", "req", LOCAL, sender.bootstrap_port, [5, 6], 20)
    assert sender.send("c", src, 20, first_token=1)
    await until(lambda: room.state == RoomState.TRANSFERRING.value, what="first chunk landed")
    fill(sender.pool, [0], seed=99)  # page 0 changes after it was sent: the checksum disagrees
    out = await outcome(room)
    assert (out.state, out.reason) == (RoomState.FAILED, "transfer_error: checksum mismatch")
    assert receiver.stats["checksum_failures"] == 1
    assert await rel.wait("c") == [5, 6]  # released once the sender acked (write window closed)


async def test_receiver_requiring_a_checksum_rejects_data_without_one(endpoints: Endpoints) -> None:
    sender, _ = await endpoints.sender(checksum=False)
    receiver, _ = await endpoints.receiver(checksum=True)
    sender.open_room("nc", "req")
    room = await receiver.open_room("nc", "req", LOCAL, sender.bootstrap_port, [5], 10)
    assert sender.send("nc", [0], 10, first_token=1)
    out = await outcome(room)
    assert out.state == RoomState.FAILED and "checksum missing" in out.reason


async def test_notification_from_another_sender_incarnation_is_rejected(
    endpoints: Endpoints,
) -> None:
    sender, _ = await endpoints.sender()
    receiver, _ = await endpoints.receiver()
    sender.open_room("s", "req")
    room = await receiver.open_room("s", "req", LOCAL, sender.bootstrap_port, [4], 10)
    await until(lambda: room.state == RoomState.WAITING_FOR_INPUT.value, what="pages posted")
    # An earlier life of the same prefill engine writes to this room and claims it finished.
    ghost = KVAgent("prefill-0@oldlife", make_pool(), asyncio.get_running_loop(), lambda *_: None)
    ghost.start()
    try:
        await ghost.add_peer(
            receiver.agent.name, receiver.agent.metadata, receiver.agent.descriptor
        )
        stale = DataNotifMsg("s", room.data["nonce"], "oldlife", 0, True, 1, first_token=66)
        await ghost.write(receiver.agent.name, [0], [4], encode(stale))
        await until(lambda: receiver.stats["stale_rejected"] == 1, what="stale notif rejected")
    finally:
        await ghost.close()
    assert room.state == RoomState.WAITING_FOR_INPUT.value  # untouched by the ghost
    assert sender.send("s", [1], 10, first_token=7)
    assert (await outcome(room)).state == RoomState.SUCCESS and room.data["first_token"] == 7


async def test_receiver_abort_mid_transfer_keeps_pages_until_the_sender_acks(
    endpoints: Endpoints,
) -> None:
    sender, s_rel = await endpoints.sender(max_chunk_pages=1, faults=SLOW)
    receiver, r_rel = await endpoints.receiver()
    s_room = sender.open_room("m", "req")
    room = await receiver.open_room("m", "req", LOCAL, sender.bootstrap_port, [7, 8, 9], 40)
    assert sender.send("m", [0, 1, 2], 40, first_token=1)
    await until(lambda: room.state == RoomState.TRANSFERRING.value, what="first chunk landed")
    assert receiver.abort("m", "client left")
    assert receiver.stats["num_fenced"] == 1 and r_rel.calls == []  # a write may still land
    out = await outcome(s_room)
    assert out.state == RoomState.FAILED and out.reason.startswith("aborted: by decode")
    assert await r_rel.wait("m") == [7, 8, 9]
    assert await s_rel.wait("m") == [0, 1, 2]
    (_, _, sender_t), (_, _, receiver_t) = s_rel.calls[0], r_rel.calls[0]
    assert sender_t <= receiver_t  # the fence lifted only after the sender's window closed
    assert receiver.stats["released_by_ack"] == 1 and receiver.stats["num_fenced"] == 0
    assert sender.stats["acks_deferred"] >= 1  # the first answer was "not yet"


async def test_sender_abort_mid_transfer_fails_receiver_and_fences_until_window_closes(
    endpoints: Endpoints,
) -> None:
    sender, s_rel = await endpoints.sender(max_chunk_pages=1, faults=SLOW)
    receiver, r_rel = await endpoints.receiver()
    sender.open_room("sa", "req")
    room = await receiver.open_room("sa", "req", LOCAL, sender.bootstrap_port, [7, 8, 9], 40)
    assert sender.send("sa", [0, 1, 2], 40, first_token=1)
    await until(lambda: room.state == RoomState.TRANSFERRING.value, what="first chunk landed")
    assert sender.abort("sa", "prefill shutting down")
    out = await outcome(room)
    assert out.state == RoomState.FAILED and out.reason.startswith("aborted: by prefill")
    assert await r_rel.wait("sa") == [7, 8, 9]
    assert s_rel.calls[0][2] <= r_rel.calls[0][2]


async def test_receiver_timeout_while_waiting_aborts_the_sender_room_too(
    endpoints: Endpoints,
) -> None:
    sender, _ = await endpoints.sender()
    deadlines = RoomDeadlines(bootstrapping_s=2.0, waiting_for_input_s=0.3, transferring_s=2.0)
    receiver, r_rel = await endpoints.receiver(deadlines=deadlines)
    s_room = sender.open_room("t", "req")  # the prefill never computes
    room = await receiver.open_room("t", "req", LOCAL, sender.bootstrap_port, [2], 10)
    assert (await outcome(room)).reason == "timeout:WaitingForInput"
    out = await outcome(s_room)
    assert out.state == RoomState.FAILED and "timeout:WaitingForInput" in out.reason
    assert await r_rel.wait("t") == [2]
    assert receiver.stats["released_by_ack"] == 1


async def test_receiver_keeps_its_agent_warm_while_a_room_may_still_be_written(
    endpoints: Endpoints,
) -> None:
    # A room expecting writes holds the agent warm (writes need its polling to progress);
    # success ends the hold; an abort mid-transfer passes it to the fence until the ack.
    sender, _ = await endpoints.sender(max_chunk_pages=1, faults=SLOW)
    receiver, r_rel = await endpoints.receiver()

    def holds() -> int:
        return receiver.agent.debug_dict()["warm_holds"]

    assert holds() == 0
    sender.open_room("ok", "req")
    room = await receiver.open_room("ok", "req", LOCAL, sender.bootstrap_port, [1], 10)
    assert holds() == 1
    assert sender.send("ok", [0], 10, first_token=3)
    assert (await outcome(room)).state == RoomState.SUCCESS
    assert holds() == 0

    sender.open_room("ab", "req")
    room = await receiver.open_room("ab", "req", LOCAL, sender.bootstrap_port, [4, 5, 6], 40)
    assert sender.send("ab", [0, 1, 2], 40, first_token=1)
    await until(lambda: room.state == RoomState.TRANSFERRING.value, what="first chunk landed")
    assert receiver.abort("ab", "client left")
    assert receiver.stats["num_fenced"] == 1 and holds() == 1  # a write may still land
    assert await r_rel.wait("ab") == [4, 5, 6]
    assert holds() == 0
