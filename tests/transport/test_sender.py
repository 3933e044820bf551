"""KVSender (in one process, real NIXL): room orders, send ownership, aborts, deadlines."""

from __future__ import annotations

import pytest

from pdserve.fsm import DuplicateRoomError, RoomState
from tests.transport.conftest import Endpoints, fill, outcome, pages_equal, until

LOCAL = "127.0.0.1"


async def test_pages_move_and_first_token_arrives_when_engine_opens_first(
    endpoints: Endpoints,
) -> None:
    sender, s_rel = await endpoints.sender()
    receiver, r_rel = await endpoints.receiver()
    s_room = sender.open_room("r1", "req-1")
    fill(sender.pool, [0, 1, 2], seed=1)
    r_room = await receiver.open_room("r1", "req-1", LOCAL, sender.bootstrap_port, [7, 9, 11], 40)
    assert sender.send("r1", [0, 1, 2], 40, first_token=321)
    assert (await outcome(r_room)).state == RoomState.SUCCESS
    assert (await outcome(s_room)).state == RoomState.SUCCESS
    assert r_room.data["first_token"] == 321
    assert pages_equal(sender.pool, [0, 1, 2], receiver.pool, [7, 9, 11])
    assert await s_rel.wait("r1") == [0, 1, 2]  # the sender hands its pages back
    assert r_rel.calls == []  # on success the decode engine keeps its pages
    stats = sender.stats
    assert stats["rooms_sent"] == 1 and stats["bytes_sent"] == 3 * sender.pool.page_bytes


async def test_decode_may_post_pages_before_the_engine_opens_the_room(endpoints: Endpoints) -> None:
    sender, _ = await endpoints.sender()
    receiver, _ = await endpoints.receiver()
    r_room = await receiver.open_room("r2", "req-2", LOCAL, sender.bootstrap_port, [3, 4], 20)
    await until(lambda: sender.table.get("r2") is not None, what="dst-first room on sender")
    assert sender.table.get("r2").state == RoomState.WAITING_FOR_INPUT.value
    s_room = sender.open_room("r2", "req-2")  # attaches to the room the decode created
    assert s_room.request_id == "req-2"
    fill(sender.pool, [5, 6], seed=2)
    assert sender.send("r2", [5, 6], 20, first_token=9)
    assert (await outcome(r_room)).state == RoomState.SUCCESS
    assert pages_equal(sender.pool, [5, 6], receiver.pool, [3, 4])


async def test_send_before_pages_arrive_starts_the_transfer_when_they_do(
    endpoints: Endpoints,
) -> None:
    sender, _ = await endpoints.sender()
    receiver, _ = await endpoints.receiver()
    s_room = sender.open_room("r3", "req-3")
    fill(sender.pool, [1], seed=3)
    assert sender.send("r3", [1], 5, first_token=1)
    assert s_room.state == RoomState.BOOTSTRAPPING.value
    r_room = await receiver.open_room("r3", "req-3", LOCAL, sender.bootstrap_port, [2], 5)
    assert (await outcome(r_room)).state == RoomState.SUCCESS
    assert pages_equal(sender.pool, [1], receiver.pool, [2])


async def test_scattered_pages_in_chunks_arrive_intact(endpoints: Endpoints) -> None:
    sender, _ = await endpoints.sender(max_chunk_pages=2, checksum=True)
    receiver, _ = await endpoints.receiver(checksum=True)
    src, dst = [0, 5, 6, 7, 20, 3, 40], [60, 2, 3, 10, 11, 12, 30]
    fill(sender.pool, src, seed=4)
    sender.open_room("r4", "req-4")
    r_room = await receiver.open_room("r4", "req-4", LOCAL, sender.bootstrap_port, dst, 100)
    assert sender.send("r4", src, 100, first_token=4)
    assert (await outcome(r_room)).state == RoomState.SUCCESS
    assert pages_equal(sender.pool, src, receiver.pool, dst)
    assert sender.stats["chunks_sent"] == 4 and r_room.num_chunks == 3


async def test_pages_the_decode_holds_cached_are_not_written_and_all_are_released(
    endpoints: Endpoints,
) -> None:
    sender, s_rel = await endpoints.sender(checksum=True)
    receiver, _ = await endpoints.receiver(checksum=True)
    src = [0, 1, 2, 3]
    fill(sender.pool, src, seed=5)
    sender.open_room("r9", "req-9")
    # The decode holds the first two pages of the prompt: it lends two pages for the rest.
    r_room = await receiver.open_room(
        "r9", "req-9", LOCAL, sender.bootstrap_port, [30, 31], 60, num_cached_pages=2
    )
    assert sender.send("r9", src, 60, first_token=8)
    assert (await outcome(r_room)).state == RoomState.SUCCESS
    assert pages_equal(sender.pool, [2, 3], receiver.pool, [30, 31])
    assert sender.stats["bytes_sent"] == 2 * sender.pool.page_bytes
    assert await s_rel.wait("r9") == src  # every page the engine handed over comes back


async def test_a_decode_holding_every_page_fails_the_room_and_the_pages_come_back(
    endpoints: Endpoints,
) -> None:
    sender, s_rel = await endpoints.sender()
    receiver, _ = await endpoints.receiver()
    sender.open_room("r10", "req-10")
    r_room = await receiver.open_room(
        "r10", "req-10", LOCAL, sender.bootstrap_port, [30], 16, num_cached_pages=1
    )
    assert sender.send("r10", [4], 16, first_token=8)
    assert (await outcome(r_room)).state == RoomState.FAILED
    assert await s_rel.wait("r10") == [4]


async def test_second_open_of_a_live_room_is_a_duplicate(endpoints: Endpoints) -> None:
    sender, _ = await endpoints.sender()
    room = sender.open_room("dup", "req-a")
    with pytest.raises(DuplicateRoomError):
        sender.open_room("dup", "req-b")
    assert sender.table.get("dup") is room and room.request_id == "req-a"
    assert sender.stats["duplicate_rejected"] == 1


async def test_send_to_an_ended_room_returns_false_and_leaves_the_pages(
    endpoints: Endpoints,
) -> None:
    sender, rel = await endpoints.sender()
    sender.open_room("gone", "req")
    assert sender.abort("gone", "client left")
    assert not sender.send("gone", [1, 2], 10, first_token=0)
    assert rel.calls == []  # never owned: nothing to hand back
    assert not sender.abort("gone")  # already ended


async def test_send_twice_is_a_programming_error(endpoints: Endpoints) -> None:
    sender, _ = await endpoints.sender()
    sender.open_room("twice", "req")
    assert sender.send("twice", [1], 3, first_token=0)
    with pytest.raises(RuntimeError, match="twice"):
        sender.send("twice", [2], 3, first_token=0)


async def test_room_without_a_decode_ends_by_bootstrap_deadline_and_frees_pages(
    endpoints: Endpoints,
) -> None:
    sender, rel = await endpoints.sender()
    room = sender.open_room("lonely", "req")
    assert sender.send("lonely", [4, 5], 10, first_token=0)
    out = await outcome(room)
    assert (out.state, out.reason) == (RoomState.FAILED, "timeout:Bootstrapping")
    assert await rel.wait("lonely") == [4, 5]
    assert len(sender.table) == 0


async def test_abort_before_bootstrap_is_reported_to_a_late_decode(endpoints: Endpoints) -> None:
    sender, s_rel = await endpoints.sender()
    receiver, r_rel = await endpoints.receiver()
    sender.open_room("early", "req")
    assert sender.send("early", [8], 5, first_token=0)
    assert sender.abort("early", "client left")
    assert await s_rel.wait("early") == [8]
    r_room = await receiver.open_room("early", "req", LOCAL, sender.bootstrap_port, [1], 5)
    out = await outcome(r_room)
    assert out.state == RoomState.FAILED and out.reason.startswith("aborted: by prefill")
    assert await r_rel.wait("early", within_s=1.0) == [1]  # the sender never had them: no fence
    assert len(sender.table) == 0 and sender.stats["late_rejected"] == 1


async def test_decode_abort_before_the_request_arrives_fails_the_later_open(
    endpoints: Endpoints,
) -> None:
    sender, _ = await endpoints.sender()
    receiver, r_rel = await endpoints.receiver()
    r_room = await receiver.open_room("pre", "req", LOCAL, sender.bootstrap_port, [2], 5)
    await until(lambda: "pre" in sender.table, what="dst post")
    assert receiver.abort("pre", "client left")
    assert await r_rel.wait("pre") == [2]  # acked at once: no write was outstanding
    assert (await outcome(r_room)).reason == "aborted: client left"
    s_room = sender.open_room("pre", "req")  # the prefill request arrives late
    out = await outcome(s_room, within_s=0.5)
    assert out.state == RoomState.FAILED and out.reason.startswith("aborted: by decode")
