"""Draft-model speculation changes no token: the demo pair (a random draft of another seed, so
most drafts are rejected and rollback runs at nearly every step) gives the plain stream, greedy,
seeded and structured, alone and among batch mates, chunked and over cache hits."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.grammar import GrammarCompiler, GrammarSpec
from pdserve.model_runner import ModelRunner
from pdserve.spec.config import SpeculativeConfig

from .harness import both, greedy, seeded
from .test_engine_ngram import CODE, biased


@pytest.fixture(scope="module")
def draft_spec(draft_dir: Path) -> SpeculativeConfig:
    return SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=str(draft_dir),
                             disable_batch_size=8, adaptive=False)  # fmt: skip


@pytest.fixture(scope="module")
def self_spec(demo_dir: Path) -> SpeculativeConfig:
    """The target as its own draft: every draft is accepted (the longest runs)."""
    return SpeculativeConfig("draft", num_speculative_tokens=4, draft_model=str(demo_dir),
                             disable_batch_size=8, adaptive=False)  # fmt: skip


def test_greedy_and_seeded_alone(target: ModelRunner, draft_spec, self_spec) -> None:
    ids = target.tokenizer.encode(CODE)
    for spec in (draft_spec, self_spec):
        for sp in (greedy(20, ignore_eos=True), seeded(20, 4, ignore_eos=True),
                   seeded(20, 5, ignore_eos=True, logit_bias=biased(ids))):  # fmt: skip
            plain, seen, stats = both(target, [(ids, sp)], spec)
            assert seen == plain
            assert stats.draft_tokens > 0
    assert stats.accepted_tokens == stats.draft_tokens  # its own draft: all accepted


def test_among_seven_chunked_cached_and_structured(target: ModelRunner, draft_spec) -> None:
    tok = target.tokenizer
    compiler = GrammarCompiler(tok.backend.to_str(), tok.vocab_size, tok.eos_token_ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def matcher() -> object:
        return compiler.compile(GrammarSpec.json_schema(schema))

    base = tok.encode(CODE * 2)
    reqs: list = []
    for i in range(8):
        ids = base + tok.encode(f" y{i}")
        sp = greedy(16, ignore_eos=True) if i % 2 else seeded(16, i, ignore_eos=True)
        reqs.append((ids, sp, matcher) if i == 3 else (ids, sp))
    for budget, warm in ((2048, ()), (6, ()), (2048, [base])):
        plain, seen, stats = both(target, reqs, draft_spec, budget=budget, warm=warm)
        assert seen == plain, f"budget {budget}"
        assert stats.draft_tokens > stats.accepted_tokens  # rollback ran


def test_endings_inside_a_run(target: ModelRunner, self_spec) -> None:
    ids = target.tokenizer.encode(CODE)
    plain, _, _ = both(target, [(ids, greedy(12, ignore_eos=True))], self_spec)
    out = plain[0].ids
    for n in (1, 2, 5, 7):
        plain, seen, _ = both(target, [(ids, greedy(n, ignore_eos=True))], self_spec)
        assert seen == plain
    plain, seen, _ = both(target, [(ids, greedy(12, stop_token_ids=[out[5]]))], self_spec)
    assert seen == plain and seen[0].finish == "stop"
    stop = plain[0].text[-3:-1] if len(plain[0].text) > 3 else None
    if stop and stop.strip():
        plain, seen, _ = both(target, [(ids, greedy(12, ignore_eos=True, stop=[stop]))],
                              self_spec)  # fmt: skip
        assert seen == plain


def test_a_failing_draft_turns_speculation_off_not_the_requests(
    target: ModelRunner, tmp_path: Path
) -> None:
    """A draft directory that is not a model: the first verify's load fails, speculation goes
    off with its reason kept, and every request is served plain."""
    (tmp_path / "config.json").write_text("{}")
    spec = SpeculativeConfig("draft", num_speculative_tokens=3, draft_model=str(tmp_path),
                             adaptive=False)  # fmt: skip
    ids = target.tokenizer.encode(CODE)
    plain, seen, stats = both(target, [(ids, greedy(8, ignore_eos=True))], spec)
    assert seen == plain and stats.verify_steps == 0


def test_a_missing_draft_model_is_refused_at_start(target: ModelRunner, tmp_path: Path) -> None:
    from pdserve.kernels.kv_cache import PageAllocator
    from pdserve.spec.build import build_speculator

    spec = SpeculativeConfig("draft", draft_model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="does not exist"):
        build_speculator(spec, target, PageAllocator(8), 64)


def test_the_draft_finds_an_ended_requests_prompt_in_its_prefix_cache(
    target: ModelRunner, draft_spec
) -> None:
    """The same prompt twice, one after the other: the second's draft prefill starts after the
    first's keyed pages, and both streams are the plain ones."""
    import asyncio

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.engine.protocol import GenerateRequest

    ids = target.tokenizer.encode(CODE * 2)

    async def go(spec: SpeculativeConfig | None) -> tuple[list[tuple[int, ...]], object]:
        engine = Engine(EngineConfig(speculative=spec), target, incarnation="t")
        await engine.start()
        try:
            outs = []
            for i, sp in enumerate((greedy(12, ignore_eos=True), seeded(12, 1, ignore_eos=True))):
                req = GenerateRequest(f"r{i}", list(ids), sp)
                outs.append(tuple(t for o in [o async for o in engine.generate(req)]
                                  for t in o.token_ids))  # fmt: skip
            return outs, engine.steps.speculator
        finally:
            await engine.stop()

    plain, _ = asyncio.run(go(None))
    seen, speculator = asyncio.run(go(draft_spec))
    assert seen == plain
    cache = speculator.proposer.cache  # type: ignore[union-attr]
    assert cache.stats.num_queries == 2 and cache.stats.hit_tokens > 0
