"""The engine with prefix caching and chunked prefill: same greedy tokens, reused pages, decode
rows that keep moving while a long prompt is prefilled."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.protocol import GenerateRequest
from pdserve.engine.scheduler import SchedulerConfig
from pdserve.grammar import GrammarSpec
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sampling_params import SamplingParams
from tests.engine.test_engine import assert_idle, collect, tokens
from tests.engine.test_engine_grammar import PATTERN, _compiler

PAGE = 4
GREEDY = dict(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def served_runner(demo_dir: Path) -> ModelRunner:
    # The dtype users serve (the demo checkpoint's bf16): a token must not depend on which rows
    # shared its forward, whatever the rounding (tests/engine/test_invariance.py: bit for bit).
    return ModelRunner(RunnerConfig(str(demo_dir), page_size=PAGE, num_pages=96))


async def started(runner: ModelRunner, **sched: object) -> Engine:
    engine = Engine(EngineConfig(scheduler=SchedulerConfig(**sched)), runner, incarnation="test")
    await engine.start()
    return engine


def prompts() -> list[list[int]]:
    """A base prompt, then prompts sharing none, some and all of its pages (in order)."""
    base = [(7 * i) % 200 + 3 for i in range(22)]
    return [
        base,
        [(11 * i) % 190 + 5 for i in range(17)],  # shares nothing
        base[:9] + [101, 102, 103, 104, 105],  # shares two pages
        base[:12] + [77],  # three pages, then one new token
        list(base),  # all of it
        base[:20],  # a page-aligned prefix of it: its last page is recomputed
    ]


async def run_in_order(engine: Engine, ids_list: list[list[int]]) -> list[tuple[list[int], int]]:
    out = []
    for i, ids in enumerate(ids_list):
        outs = await collect(engine, f"r{i}", ids, **GREEDY)
        out.append((tokens(outs), outs[-1].num_cached_tokens))
    return out


@pytest.mark.parametrize("chunked", [True, False])
async def test_greedy_tokens_are_the_same_with_the_prefix_cache_on_and_off(
    served_runner: ModelRunner, chunked: bool
):
    results = {}
    for caching in (False, True):
        engine = await started(
            served_runner, prefix_caching=caching, chunked_prefill=chunked, max_prefill_tokens=8
        )
        try:
            results[caching] = await run_in_order(engine, prompts())
            await assert_idle(engine)
        finally:
            await engine.stop()
    assert [t for t, _ in results[True]] == [t for t, _ in results[False]]
    assert [c for _, c in results[False]] == [0] * 6
    assert [c for _, c in results[True]] == [0, 0, 8, 12, 20, 16]


async def test_chunked_and_whole_prefill_give_the_same_greedy_tokens(served_runner: ModelRunner):
    ids = [(5 * i) % 150 + 9 for i in range(37)]
    got = []
    for chunked, budget in ((False, 2048), (True, 5), (True, 16)):
        engine = await started(
            served_runner, chunked_prefill=chunked, max_prefill_tokens=budget, prefix_caching=False
        )
        try:
            got.append(tokens(await collect(engine, "r", ids, **GREEDY)))
        finally:
            await engine.stop()
    assert got[0] == got[1] == got[2]


async def test_concurrent_requests_share_cached_pages_and_give_them_back(
    served_runner: ModelRunner,
):
    engine = await started(served_runner, max_prefill_tokens=8)
    try:
        base = list(range(30, 54))
        first = await collect(engine, "warm", base, **GREEDY)
        variants = [base[:16] + [200 + i] * 3 for i in range(4)]
        together = await asyncio.gather(
            *(collect(engine, f"c{i}", v, **GREEDY) for i, v in enumerate(variants))
        )
        assert all(outs[-1].num_cached_tokens == 16 for outs in together)
        assert first[-1].num_cached_tokens == 0
        await assert_idle(engine)
        stats = engine.prefix_cache.stats
        assert stats.hit_tokens == 4 * 16 and stats.query_tokens == 24 + 4 * 19
    finally:
        await engine.stop()


async def test_cached_pages_count_as_free_in_the_load_a_router_reads(served_runner: ModelRunner):
    engine = await started(served_runner)
    try:
        await collect(engine, "warm", list(range(30, 54)), **GREEDY)
        await assert_idle(engine)
        alloc = engine.allocator
        assert alloc.num_cached > 0 and alloc.num_free < alloc.num_pages  # the cache holds pages
        load = engine.load()
        assert load["free_pages"] == load["total_pages"] == alloc.num_pages  # all reclaimable
    finally:
        await engine.stop()


async def test_running_stream_gets_a_token_every_step_of_a_long_prompts_prefill(
    served_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
):
    engine = await started(served_runner, max_prefill_tokens=12, prefix_caching=False)
    steps: list[tuple[list[str], list[tuple[str, int]]]] = []
    step = engine.steps.run

    def spy(seqs):  # noqa: ANN001, ANN202 (the runner-thread job of one step)
        decode, prefill = seqs
        new = [(s.seq_id, s.num_tokens - s.num_cached_tokens) for s in prefill]
        steps.append(([r.request_id for r in decode], new))
        return step(seqs)

    monkeypatch.setattr(engine.steps, "run", spy)
    try:
        stream = asyncio.create_task(
            collect(engine, "stream", [5, 6, 7], max_tokens=40, temperature=0, ignore_eos=True)
        )
        deadline = asyncio.get_running_loop().time() + 30
        while not any("stream" in d for d, _ in steps):  # until the stream is decoding
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.001)  # poll with a deadline
        long_ids = [(3 * i) % 170 + 4 for i in range(100)]
        long = await collect(engine, "long", long_ids, max_tokens=2, ignore_eos=True)
        chunks = [i for i, (_, p) in enumerate(steps) if any(sid == "long" for sid, _ in p)]
        assert len(chunks) >= 100 // 12  # prefilled over many steps
        assert all("stream" in steps[i][0] for i in chunks)  # ... each one with the stream's row
        assert all(len(d) + sum(n for _, n in p) <= 12 for d, p in steps)  # the step budget
        assert len(tokens(long)) == 2
        # The rows that rode the chunks' forwards sampled what decode steps alone sample.
        solo = await collect(engine, "solo", [5, 6, 7], max_tokens=40, temperature=0,
                             ignore_eos=True)  # fmt: skip
        assert tokens(await stream) == tokens(solo)
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_prompt_logprobs_cover_the_whole_prompt_with_cache_and_chunks_on(
    served_runner: ModelRunner,
):
    """A prompt-logprobs request is prefilled whole with no cached prefix: its entries are what
    a plain whole prefill gives, though its prefix is cached and it exceeds the chunk budget."""
    base = prompts()[0]
    asked = dict(GREEDY, prompt_logprobs=0)
    plain = await started(served_runner, prefix_caching=False, chunked_prefill=False)
    try:
        expected = (await collect(plain, "p", base, **asked))[0].prompt_logprobs
    finally:
        await plain.stop()
    engine = await started(served_runner, max_prefill_tokens=8)
    try:
        await collect(engine, "warm", base, **GREEDY)  # caches its pages
        outs = await collect(engine, "lp", base, **asked)
        assert outs[-1].num_cached_tokens == 0
        got = outs[0].prompt_logprobs
        assert got is not None and expected is not None and len(got) == len(base)
        assert got[0] is None and all(e is not None for e in got[1:])
        assert [e.token_id for e in got[1:]] == base[1:]
        assert [e.logprob for e in got[1:]] == pytest.approx([e.logprob for e in expected[1:]])
        after = await collect(engine, "after", base, **GREEDY)
        assert after[-1].num_cached_tokens > 0  # its pages were cached all the same
        await assert_idle(engine)
    finally:
        await engine.stop()


async def test_a_constrained_prompt_in_chunks_samples_what_it_samples_whole(
    served_runner: ModelRunner,
):
    """Chunks before the last discard their sampled token: the grammar must not see it."""
    long_ids = [(5 * i) % 180 + 3 for i in range(30)]
    texts = []
    for chunked in (False, True):
        engine = await started(served_runner, max_prefill_tokens=8, chunked_prefill=chunked)
        try:
            sp = SamplingParams(max_tokens=30, temperature=0)
            req = GenerateRequest(f"g{chunked}", long_ids, sp)
            req.grammar = _compiler(served_runner).compile(GrammarSpec("regex", PATTERN))
            texts.append("".join([o.text async for o in engine.generate(req)]))
            await assert_idle(engine)
        finally:
            await engine.stop()
    assert re.fullmatch(PATTERN, texts[1]), texts
    assert texts[0] == texts[1]
