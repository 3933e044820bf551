"""The sender's write path: no WRITE before the KV is ready; what each room's transfer reports."""

from __future__ import annotations

from pdserve.fsm import RoomState
from pdserve.transport.observer import TransferObserver
from tests.fakes import FakeReady
from tests.transport.conftest import Endpoints, fill, outcome, pages_equal, until

LOCAL = "127.0.0.1"


async def test_no_write_is_posted_before_the_kv_is_ready_and_the_late_kv_arrives(
    endpoints: Endpoints,
) -> None:
    sender, _ = await endpoints.sender()
    receiver, _ = await endpoints.receiver()
    sender.open_room("kr", "req")
    r_room = await receiver.open_room("kr", "req", LOCAL, sender.bootstrap_port, [3, 4], 20)
    ready = FakeReady()
    assert sender.send("kr", [0, 1], 20, first_token=5, kv_ready=ready)
    await until(lambda: ready.num_queries >= 5, what="the sender polling the marker")
    assert sender.table.get("kr").state == RoomState.TRANSFERRING.value
    assert sender.agent.stats.num_writes == 0 and sender.agent.num_outstanding == 0
    assert receiver.stats["chunks_received"] == 0 and not r_room.done.done()
    # The "forward" writes the KV only now: a WRITE posted at send() would carry stale pages.
    fill(sender.pool, [0, 1], seed=11)
    ready.is_done = True
    assert (await outcome(r_room)).state == RoomState.SUCCESS
    assert pages_equal(sender.pool, [0, 1], receiver.pool, [3, 4])
    assert sender.agent.stats.num_writes == 1


async def test_kv_that_never_becomes_ready_fails_the_room_by_deadline(
    endpoints: Endpoints,
) -> None:
    sender, s_rel = await endpoints.sender(kv_ready_timeout_s=0.2)
    receiver, r_rel = await endpoints.receiver()
    s_room = sender.open_room("never", "req")
    r_room = await receiver.open_room("never", "req", LOCAL, sender.bootstrap_port, [6], 5)
    assert sender.send("never", [2], 5, first_token=1, kv_ready=FakeReady())
    out = await outcome(s_room)
    assert (out.state, out.reason) == (RoomState.FAILED, "transfer_error: kv not ready after 0.2s")
    assert (await outcome(r_room)).state == RoomState.FAILED  # told by the abort notification
    assert await s_rel.wait("never") == [2]
    assert await r_rel.wait("never") == [6]  # no write was posted: the fence lifts at once
    assert sender.agent.stats.num_writes == 0 and sender.stats["kv_not_ready"] == 1


async def test_an_abort_while_waiting_for_the_kv_posts_nothing(endpoints: Endpoints) -> None:
    sender, s_rel = await endpoints.sender()
    receiver, _ = await endpoints.receiver()
    sender.open_room("ab", "req")
    r_room = await receiver.open_room("ab", "req", LOCAL, sender.bootstrap_port, [6], 5)
    ready = FakeReady()
    assert sender.send("ab", [2], 5, first_token=1, kv_ready=ready)
    await until(lambda: ready.num_queries >= 2, what="the sender polling the marker")
    assert sender.abort("ab", "aborted: client went away")
    assert await s_rel.wait("ab") == [2]
    assert (await outcome(r_room)).state == RoomState.FAILED
    assert sender.agent.stats.num_writes == 0 and sender.stats["kv_not_ready"] == 0


class Recorder(TransferObserver):
    def __init__(self) -> None:
        self.sent: list[tuple[float, int]] = []
        self.waits: list[float] = []

    def on_room_sent(self, seconds: float, num_bytes: int) -> None:
        self.sent.append((seconds, num_bytes))

    def on_kv_ready_wait(self, seconds: float) -> None:
        self.waits.append(seconds)


async def test_each_room_reports_its_transfer_time_bytes_and_kv_wait(
    endpoints: Endpoints,
) -> None:
    recorder = Recorder()
    sender, _ = await endpoints.sender(observer=recorder, max_chunk_pages=2)
    receiver, _ = await endpoints.receiver()
    for i, pages in enumerate(([0, 1, 2], [5])):
        sender.open_room(f"m{i}", "req")
        dst = [10 + p for p in pages]
        room = await receiver.open_room(f"m{i}", "req", LOCAL, sender.bootstrap_port, dst, 20)
        assert sender.send(f"m{i}", pages, 20, first_token=1)
        assert (await outcome(room)).state == RoomState.SUCCESS
    await until(lambda: len(recorder.sent) == 2, what="both rooms reported")
    page = sender.pool.page_bytes
    assert [b for _, b in recorder.sent] == [3 * page, page]
    assert all(s > 0 for s, _ in recorder.sent) and len(recorder.waits) == 2
    assert sender.stats["bytes_sent"] == 4 * page
