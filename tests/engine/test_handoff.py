"""PD hand-offs: what the prefill hand-off gives the sender after a prefill; the decode
hand-off with a prefix cache lends a room only the pages after the cached prefix, and every page
comes back whichever way the request ends (success, abort while waiting for KV)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.handoff import DecodeHandoff, PrefillHandoff
from pdserve.engine.protocol import GenerateRequest, KVTransferParams
from pdserve.engine.request import Request, RequestState
from pdserve.engine.scheduler import SchedulerConfig
from pdserve.fsm import RoomOutcome, RoomState
from pdserve.model_runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence
from tests.engine.test_engine import assert_idle


class _Marker:
    def query(self) -> bool:
        return False


class _Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def send(self, *args: Any) -> bool:
        self.sent.append(args)
        return True


class _Engine:
    class config:  # noqa: N801 - stands in for EngineConfig
        class deadlines:  # noqa: N801
            prefill_inflight_s = 5.0

    def __init__(self) -> None:
        self.armed: list[str] = []

    def arm(self, req: Request, seconds: float, label: str) -> None:
        self.armed.append(label)


def test_prefilled_pages_go_to_the_sender_with_the_steps_kv_marker() -> None:
    sender, engine = _Sender(), _Engine()
    handoff = PrefillHandoff(engine, sender)  # type: ignore[arg-type]
    seq = Sequence("r", [1, 2, 3], 3, SamplingParams(), [4, 5])
    req = Request("r", seq, KVTransferParams("room", "127.0.0.1", 1))
    assert req.move(RequestState.PREFILLING, "prefill starts")
    marker = _Marker()
    assert handoff.on_prefilled(req, 9, None, marker)
    (args,) = sender.sent
    assert args[:4] == ("room", [4, 5], 3, 9) and args[-1] is marker
    assert req.state is RequestState.PREFILL_INFLIGHT and seq.page_ids == []
    assert engine.armed == ["timeout:inflight"]


@dataclass
class FakeRoom:
    room_id: str
    pages: list[int]
    num_cached_pages: int
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    data: dict = field(default_factory=dict)


class FakeReceiver:
    """Rooms that end when the test says; a failed room releases its lent pages (no fence)."""

    def __init__(self) -> None:
        self.rooms: dict[str, FakeRoom] = {}
        self.opened = asyncio.Queue()
        self.table = SimpleNamespace(get=self.rooms.get)
        self.engine: Engine | None = None

    async def open_room(
        self,
        room_id,
        request_id,
        host,
        port,
        pages,
        num_tokens,  # noqa: ANN001
        num_cached_pages=0,
    ):  # noqa: ANN001, ANN201
        room = FakeRoom(room_id, list(pages), num_cached_pages)
        self.rooms[room_id] = room
        self.opened.put_nowait(room)
        return room

    def succeed(self, room: FakeRoom, first_token: int) -> None:
        room.data["first_token"] = first_token
        del self.rooms[room.room_id]
        room.done.set_result(RoomOutcome(room.room_id, RoomState.SUCCESS, None))

    def abort(self, room_id: str, reason: str = "aborted") -> bool:
        room = self.rooms.pop(room_id, None)
        if room is None:
            return False
        room.done.set_result(RoomOutcome(room_id, RoomState.FAILED, reason))
        self.engine.free_pages(room.pages)  # the receiver's on_release
        return True


def request(rid: str, prompt: list[int]) -> GenerateRequest:
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    return GenerateRequest(rid, prompt, sp, KVTransferParams(rid, "127.0.0.1", 1))


async def test_decode_lends_only_uncached_pages_and_gives_every_page_back(runner: ModelRunner):
    engine = Engine(EngineConfig(role="decode"), runner, incarnation="test")
    receiver = FakeReceiver()
    receiver.engine = engine
    engine.attach_handoff(DecodeHandoff(engine, receiver))
    await engine.start()
    page = runner.kv_config.page_size
    prompt = list(range(5, 5 + 2 * page + 3))  # two full pages and a partial one
    try:

        async def run(rid: str, end: str) -> list:
            gen = engine.generate(request(rid, prompt))
            task = asyncio.create_task(anext(gen))
            room = await asyncio.wait_for(receiver.opened.get(), 10)
            if end == "abort":
                await engine.abort(rid)
                await asyncio.wait_for(task, 10)
                await gen.aclose()
                return [room]
            receiver.succeed(room, 7)
            outs = [await asyncio.wait_for(task, 10)]
            outs += [o async for o in gen]
            return [room, outs]

        [first, outs] = await run("a", "ok")
        assert (len(first.pages), first.num_cached_pages) == (3, 0)
        assert outs[-1].num_cached_tokens == 0
        [aborted] = await run("b", "abort")
        assert (len(aborted.pages), aborted.num_cached_pages) == (1, 2)
        await assert_idle(engine)
        [again, outs] = await run("c", "ok")
        assert (len(again.pages), again.num_cached_pages) == (1, 2)
        assert outs[-1].num_cached_tokens == 2 * page
        assert not set(again.pages) & set(first.pages[:2])  # never a shared page as destination
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_preempted_requests_take_freed_pages_before_new_arrivals(runner: ModelRunner):
    """Age priority on the decode role: while a preempted request waits for its re-prefill,
    an arrival lends no pages to a room; it goes once the waiting queue is empty."""
    engine = Engine(EngineConfig(role="decode"), runner, incarnation="test")
    receiver = FakeReceiver()
    receiver.engine = engine
    engine.attach_handoff(DecodeHandoff(engine, receiver))
    await engine.start()
    try:
        preempted = Request("old", Sequence("old", [1, 2, 3], 3, SamplingParams()))
        engine.scheduler.waiting.append(preempted)  # as the scheduler's _preempt leaves it
        gen = engine.generate(request("new", [4, 5, 6]))
        task = asyncio.create_task(anext(gen))
        deadline = asyncio.get_running_loop().time() + 10
        while engine.count_by_state()["waiting_for_kv"] == 0:  # admitted
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.001)  # poll with a deadline
        assert receiver.opened.empty() and engine.allocator.num_used == 0
        engine.scheduler.waiting.clear()
        engine.handoff.on_pages_freed()
        room = await asyncio.wait_for(receiver.opened.get(), 10)
        receiver.succeed(room, 7)
        await asyncio.wait_for(task, 10)
        await gen.aclose()
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_the_decode_role_runs_at_most_max_num_seqs_at_once(runner: ModelRunner, monkeypatch):  # noqa: ANN001
    sched = SchedulerConfig(max_num_seqs=2)
    engine = Engine(EngineConfig(role="decode", scheduler=sched), runner, incarnation="test")
    receiver = FakeReceiver()
    receiver.engine = engine
    engine.attach_handoff(DecodeHandoff(engine, receiver))
    await engine.start()
    widths: list[int] = []
    decode = runner.decode

    def spy(seqs):  # noqa: ANN001, ANN202
        widths.append(len(seqs))
        return decode(seqs)

    monkeypatch.setattr(runner, "decode", spy)  # after start(): calibration is done
    try:
        sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        gens = [
            engine.generate(GenerateRequest(f"d{i}", [3 + i, 4, 5], sp,
                                            KVTransferParams(f"d{i}", "127.0.0.1", 1)))
            for i in range(5)
        ]  # fmt: skip
        tasks = [asyncio.create_task(_drain(g)) for g in gens]
        for _ in range(5):
            room = await asyncio.wait_for(receiver.opened.get(), 10)
            receiver.succeed(room, 7)
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert all(sum(len(o.token_ids) for o in out) == 6 for out in outs)
        assert widths and max(widths) <= 2
        await assert_idle(engine)
    finally:
        await engine.stop()


async def _drain(gen) -> list:  # noqa: ANN001
    return [o async for o in gen]


async def test_the_priority_policy_lends_pages_to_the_decode_rooms_in_priority_order(
    runner: ModelRunner,
):
    sched = SchedulerConfig(policy="priority")
    engine = Engine(EngineConfig(role="decode", scheduler=sched), runner, incarnation="test")
    receiver = FakeReceiver()
    receiver.engine = engine
    engine.attach_handoff(DecodeHandoff(engine, receiver))
    await engine.start()
    try:
        blocker = Request("old", Sequence("old", [1, 2, 3], 3, SamplingParams()))
        engine.scheduler.waiting.append(blocker)  # lends nothing while it waits
        gens = []
        for rid, priority in (("low", 10), ("mid", 5), ("high", 0)):
            req = request(rid, [4, 5, 6])
            req.priority = priority
            gens.append(engine.generate(req))
        tasks = [asyncio.create_task(anext(g)) for g in gens]
        deadline = asyncio.get_running_loop().time() + 10
        while engine.count_by_state()["waiting_for_kv"] < 3:  # all admitted
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.001)  # poll with a deadline
        engine.scheduler.waiting.clear()
        engine.handoff.on_pages_freed()
        rooms = [await asyncio.wait_for(receiver.opened.get(), 10) for _ in range(3)]
        assert [r.room_id for r in rooms] == ["high", "mid", "low"]
        for room in rooms:
            receiver.succeed(room, 7)
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        for g in gens:
            await g.aclose()
        await assert_idle(engine)
    finally:
        await engine.stop()
