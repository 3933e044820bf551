"""The colocated engine in-process: generation, batching, stops, aborts, deadlines, preemption."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.engine.config import EngineConfig, RequestDeadlines
from pdserve.engine.engine import Engine
from pdserve.engine.protocol import EngineError, GenerateOutput, GenerateRequest
from pdserve.engine.scheduler import SchedulerConfig
from pdserve.model_runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence
from tests.fakes import FakeReady


async def started(runner: ModelRunner, **cfg: object) -> Engine:
    engine = Engine(EngineConfig(**cfg), runner, incarnation="test")
    await engine.start()
    return engine


async def collect(engine: Engine, rid: str, ids: list[int], **sp: object) -> list[GenerateOutput]:
    req = GenerateRequest(rid, ids, SamplingParams(**sp))
    return [out async for out in engine.generate(req)]


def tokens(outs: list[GenerateOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


async def assert_idle(engine: Engine, timeout_s: float = 10.0) -> None:
    """Requests are gone at once; pages of a request that ended mid-step come back at step end."""
    assert engine.debug_requests() == []
    assert all(n == 0 for n in engine.count_by_state().values())
    deadline = asyncio.get_running_loop().time() + timeout_s
    alloc = engine.allocator
    while alloc.num_used or alloc.num_free + alloc.num_cached != alloc.num_pages:
        assert asyncio.get_running_loop().time() < deadline, "pages not freed"
        await asyncio.sleep(0.005)  # poll with a deadline
    engine.allocator.check_integrity()


def runner_loop(runner: ModelRunner, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy tokens of one prompt straight from the runner: a prefill, then decode steps."""
    pages = list(range(runner.kv_config.pages_for(len(prompt) + num_tokens)))
    seq = Sequence("ref", list(prompt), len(prompt), SamplingParams(temperature=0), pages)
    out = runner.prefill([seq]).token_ids
    while len(out) < num_tokens:
        seq.num_cached_tokens = seq.num_tokens
        seq.token_ids.append(out[-1])
        out += runner.decode([seq]).token_ids
    return out


async def test_greedy_generation_equals_plain_runner_loop(runner: ModelRunner):
    prompt = runner.tokenizer.encode("Hello world")
    expected = runner_loop(runner, prompt, 10)  # before the engine owns the pages
    engine = await started(runner)
    try:
        outs = await collect(engine, "r1", prompt, max_tokens=10, temperature=0, ignore_eos=True)
        assert tokens(outs) == expected
        assert outs[-1].finish_reason == "length" and outs[-1].num_generated_tokens == 10
        assert "".join(o.text for o in outs) == runner.tokenizer.decode(tokens(outs))
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_concurrent_requests_batch_and_match_solo_runs(runner: ModelRunner):
    engine = await started(runner)
    try:
        prompts = [runner.tokenizer.encode("x " * n) for n in (1, 5, 17, 33)]
        sp = dict(max_tokens=8, temperature=0, ignore_eos=True)
        together = await asyncio.gather(
            *(collect(engine, f"c{i}", p, **sp) for i, p in enumerate(prompts))
        )
        for i, p in enumerate(prompts):
            alone = await collect(engine, f"s{i}", p, **sp)
            assert tokens(together[i]) == tokens(alone)
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_stop_string_is_trimmed_and_never_streamed(runner: ModelRunner):
    engine = await started(runner)
    try:
        prompt = runner.tokenizer.encode("abc")
        free = await collect(engine, "f", prompt, max_tokens=12, temperature=0, ignore_eos=True)
        text = "".join(o.text for o in free)
        stop = text[3:6]
        assert stop.strip(), "need a visible stop string"
        outs = await collect(
            engine, "s", prompt, max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]
        )
        streamed = "".join(o.text for o in outs)
        assert streamed == text[: text.index(stop)]
        assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_abort_ends_stream_and_frees_pages(runner: ModelRunner):
    engine = await started(runner)
    try:
        req = GenerateRequest("a", [1, 2, 3], SamplingParams(max_tokens=10_000, ignore_eos=True))
        seen = 0
        async for out in engine.generate(req):
            seen += 1
            if seen == 3:
                assert await engine.abort("a")
            if out.finish_reason:
                assert out.finish_reason == "abort"
        assert not await engine.abort("a")  # a finished request cannot be aborted again
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_consumer_that_goes_away_aborts_its_request(runner: ModelRunner):
    engine = await started(runner)
    try:
        gen = engine.generate(
            GenerateRequest("g", [5, 6], SamplingParams(max_tokens=10_000, ignore_eos=True))
        )
        await anext(gen)
        await gen.aclose()
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_queue_deadline_fails_waiting_request_with_504(runner: ModelRunner):
    """A request that never gets a prefill slot (the only row is taken) times out waiting."""
    engine = await started(
        runner, deadlines=RequestDeadlines(waiting_s=0.2),
        scheduler=SchedulerConfig(max_num_seqs=1),
    )  # fmt: skip
    try:
        busy = engine.generate(
            GenerateRequest("busy", [1], SamplingParams(max_tokens=10_000, ignore_eos=True))
        )
        await asyncio.wait_for(anext(busy), 10.0)  # it holds the one row
        with pytest.raises(EngineError) as err:
            await collect(engine, "t", [1, 2, 3], max_tokens=4)
        assert err.value.status == 504 and err.value.code == "timeout:waiting"
        assert "state waiting" in err.value.message
        await busy.aclose()
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_duplicate_request_id_is_rejected_while_live(runner: ModelRunner):
    engine = await started(runner)
    try:
        gen = engine.generate(
            GenerateRequest("d", [1], SamplingParams(max_tokens=10_000, ignore_eos=True))
        )
        await anext(gen)
        with pytest.raises(EngineError) as err:
            await collect(engine, "d", [1], max_tokens=2)
        assert err.value.status == 409
        await gen.aclose()
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_preemption_under_page_pressure_keeps_greedy_outputs(small_runner: ModelRunner):
    engine = await started(small_runner)
    try:
        prompts = [[7 + i] * 6 for i in range(4)]
        sp = dict(max_tokens=20, temperature=0, ignore_eos=True)
        solo = [tokens(await collect(engine, f"s{i}", p, **sp)) for i, p in enumerate(prompts)]
        together = await asyncio.gather(
            *(collect(engine, f"c{i}", p, **sp) for i, p in enumerate(prompts))
        )
        assert [tokens(t) for t in together] == solo
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_request_ending_by_length_is_left_out_of_the_next_step(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
):
    """Overlap emits a step's deltas after the next step is submitted; a request whose token
    ends it (length, stop token) must already be out of that next step."""
    steps: list[list[str]] = []
    decode = runner.decode

    def spy(seqs: list) -> object:
        steps.append([s.seq_id for s in seqs])
        return decode(seqs)

    monkeypatch.setattr(runner, "decode", spy)
    engine = await started(runner)
    try:
        prompt = runner.tokenizer.encode("count")
        short, long = await asyncio.gather(
            collect(engine, "short", prompt, max_tokens=3, temperature=0, ignore_eos=True),
            collect(engine, "long", prompt, max_tokens=9, temperature=0, ignore_eos=True),
        )
        assert len(tokens(short)) == 3 and len(tokens(long)) == 9
        # Prefill samples token 1; each decode step adds one: exactly max_tokens - 1 steps.
        assert sum("short" in s for s in steps) == 2
        assert sum("long" in s for s in steps) == 8
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_deltas_of_a_step_stream_in_token_order_across_overlapped_steps(runner: ModelRunner):
    engine = await started(runner)
    try:
        prompt = runner.tokenizer.encode("order")
        req = GenerateRequest("ord", prompt, SamplingParams(max_tokens=12, temperature=0,
                                                           ignore_eos=True))  # fmt: skip
        counts = [out.num_generated_tokens async for out in engine.generate(req)]
        assert counts == sorted(counts) and counts[-1] == 12
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_start_measures_decode_threads_unless_they_are_given(demo_dir, monkeypatch):
    from pdserve.model_runner import RunnerConfig  # noqa: PLC0415

    auto = ModelRunner(RunnerConfig(str(demo_dir), kv_cache_bytes=16 << 20, num_threads=2))
    engine = await started(auto)
    try:
        assert auto.decode_threads in (1, 2)
        await assert_idle(engine)  # the scratch sequences gave their pages back
    finally:
        await engine.stop()
    fixed = ModelRunner(
        RunnerConfig(str(demo_dir), kv_cache_bytes=16 << 20, num_threads=2, decode_threads=2)
    )
    calls: list[object] = []
    monkeypatch.setattr(fixed, "calibrate_decode_threads", calls.append)
    engine = await started(fixed)
    await engine.stop()
    assert calls == [] and fixed.decode_threads == 2


async def test_pages_freed_during_a_step_wait_for_its_kv_writes(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
):
    """On a device the step's kernels may still write its pages after the host got its output:
    pages freed meanwhile return to the allocator only once the step's marker completed."""
    engine = await started(runner)
    loop = asyncio.get_running_loop()
    ready, in_step, go = FakeReady(), asyncio.Event(), threading.Event()
    decode = runner.decode

    def held_decode(seqs: list) -> object:
        loop.call_soon_threadsafe(in_step.set)
        assert go.wait(10.0)
        out = decode(seqs)
        out.kv_ready = ready
        return out

    monkeypatch.setattr(runner, "decode", held_decode)  # after start(): calibration is done
    try:
        sp = SamplingParams(max_tokens=50, ignore_eos=True)
        gen = engine.generate(GenerateRequest("held", [1, 2, 3], sp))
        await asyncio.wait_for(anext(gen), 10.0)
        await asyncio.wait_for(in_step.wait(), 10.0)
        assert await engine.abort("held")  # during the forward: the free is deferred
        go.set()
        deadline = loop.time() + 10.0
        while ready.num_queries < 3:  # the step ended and its marker was polled, still pending
            assert loop.time() < deadline, "the step's marker was never polled"
            await asyncio.sleep(0.005)  # poll with a deadline
        assert engine.allocator.num_free < engine.allocator.num_pages
        ready.is_done = True
        await assert_idle(engine)
        await gen.aclose()
    finally:
        go.set()
        await engine.stop()


async def test_a_running_request_ends_at_its_derived_overall_deadline(runner: ModelRunner):
    """No flag given: RUNNING is bounded too, by base + per-token budget x tokens."""
    deadlines = RequestDeadlines(request_base_s=0.3, request_per_token_s=0.0)
    engine = await started(runner, deadlines=deadlines)
    try:
        req = GenerateRequest("long", [1, 2, 3], SamplingParams(max_tokens=10_000, ignore_eos=True))
        got: list[GenerateOutput] = []
        with pytest.raises(EngineError) as err:
            async for out in engine.generate(req):
                got.append(out)
        assert got, "it ran before the deadline"
        assert err.value.status == 504 and err.value.code == "timeout:request"
        assert "state running" in err.value.message
        await assert_idle(engine)
    finally:
        await engine.stop()
