from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdserve.api.errors import ApiError
from pdserve.api.generation import ChoiceStreams
from pdserve.engine.protocol import EngineError, GenerateOutput, GenerateRequest
from pdserve.sampling_params import SamplingParams

from .conftest import wait_until
from .engine_double import FakeEngine


def _requests(num: int, max_tokens: int = 4) -> list[GenerateRequest]:
    return [
        GenerateRequest(f"r-{i}", [65 + i, 66 + i], SamplingParams(max_tokens=max_tokens))
        for i in range(num)
    ]


async def _drain(streams: ChoiceStreams) -> list[tuple[int, GenerateOutput]]:
    events = []
    async with asyncio.timeout(5):
        while batch := await streams.next_batch():
            events.extend(batch)
    return events


async def test_merges_all_choices_until_each_finishes() -> None:
    engine = FakeEngine()
    streams = ChoiceStreams(engine, _requests(3), abort_timeout_s=1)
    streams.start()
    events = await _drain(streams)
    await streams.aclose("ended")
    for index in range(3):
        mine = [out for i, out in events if i == index]
        assert "".join(o.text for o in mine) == chr(65 + index) + chr(66 + index) + chr(
            65 + index
        ) + chr(66 + index)
        assert mine[-1].finish_reason == "length"
    assert streams.is_done and engine.aborts == [] and engine.live == {}


async def test_close_aborts_only_unfinished_choices_with_the_reason() -> None:
    engine = FakeEngine()
    reqs = _requests(2, max_tokens=1) + [
        GenerateRequest("r-hang", [70], SamplingParams(max_tokens=10))
    ]
    engine.hang_after = 1  # r-0 and r-1 finish at 1 token; r-hang waits after its first token
    streams = ChoiceStreams(engine, reqs, abort_timeout_s=1)
    streams.start()
    seen: set[int] = set()
    async with asyncio.timeout(5):
        while len(seen) < 3:
            seen.update(i for i, _ in await streams.next_batch())
    await wait_until(lambda: "r-hang" in engine.live)
    await streams.aclose("client_disconnected")
    assert engine.aborts == [("r-hang", "client_disconnected")]
    await wait_until(lambda: not engine.live)


async def test_engine_error_surfaces_from_next_batch() -> None:
    engine = FakeEngine()
    engine.fail_error = EngineError("peer lost", status=503, code="peer_lost")
    engine.fail_after = 2
    streams = ChoiceStreams(engine, _requests(1, max_tokens=8), abort_timeout_s=1)
    streams.start()
    with pytest.raises(EngineError, match="peer lost"):
        await _drain(streams)
    await streams.aclose("error")


async def test_deadline_backstop_raises_504_and_close_aborts() -> None:
    engine = FakeEngine()
    engine.hang_after = 0
    streams = ChoiceStreams(engine, _requests(2), abort_timeout_s=1, deadline_s=0.05)
    streams.start()
    with pytest.raises(ApiError) as info:
        await _drain(streams)
    assert info.value.status == 504 and info.value.code == "timeout:request"
    await streams.aclose("timeout:request")
    assert engine.aborted_ids() == {"r-0", "r-1"}


class _TruncatingEngine(FakeEngine):
    """Breaks the contract: its stream ends without a finish_reason."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        async def gen() -> AsyncIterator[GenerateOutput]:
            yield GenerateOutput(request.request_id, [65], "A", 2, 1)

        return gen()


async def test_stream_ending_without_finish_reason_is_closed_as_abort() -> None:
    streams = ChoiceStreams(_TruncatingEngine(), _requests(1), abort_timeout_s=1)
    streams.start()
    events = await _drain(streams)
    assert [o.finish_reason for _, o in events] == [None, "abort"]
    assert events[-1][1].num_generated_tokens == 1


async def test_aclose_twice_aborts_once() -> None:
    engine = FakeEngine()
    engine.hang_after = 0
    streams = ChoiceStreams(engine, _requests(1), abort_timeout_s=1)
    streams.start()
    await wait_until(lambda: "r-0" in engine.live)
    await asyncio.gather(streams.aclose("a"), streams.aclose("b"))
    assert engine.aborts == [("r-0", "a")]
