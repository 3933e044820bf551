"""Background bitmask fills: the same masks as serial fills, failures kept to their matcher,
and the llguidance state never shared between the loop and the filler's thread."""

from __future__ import annotations

import ctypes
import random
import threading

import torch

from pdserve.grammar import GrammarCompiler, GrammarSpec
from pdserve.grammar import matcher as matcher_module
from pdserve.grammar.filler import MaskFiller
from pdserve.grammar.matcher import GrammarMatcher, prefetch_all

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
WAIT_S = 10.0


def _serial(compiler: GrammarCompiler, spec: GrammarSpec) -> GrammarMatcher:
    """A matcher of ``spec`` that fills on the calling thread (the reference)."""
    matcher = compiler.compile(spec)
    return GrammarMatcher(matcher.llguidance_matcher.deep_copy(), compiler.vocab_size)


def _allowed(row: torch.Tensor) -> list[int]:
    bits = (row.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten().nonzero().flatten().tolist()


class GatedLLMatcher:
    """An llguidance matcher double: its fill waits for ``gate``, records the order of calls,
    and raises when ``fails``. Its mask allows token 0 only."""

    def __init__(self, gate: threading.Event | None = None, fails: bool = False) -> None:
        self.gate, self.fails = gate, fails
        self.calls: list[str] = []
        self.started = threading.Event()

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        self.calls.append("fill")
        if self.fails:
            raise RuntimeError("parser exploded")
        row = torch.zeros(size // 4, dtype=torch.int32)
        row[0] = 1
        ctypes.memmove(ptr, row.data_ptr(), size)

    def consume_token(self, token: int) -> bool:
        self.calls.append("consume")
        return True

    def is_stopped(self) -> bool:
        return False

    def is_accepting(self) -> bool:
        return False

    def is_error(self) -> bool:
        return False


def test_prefetched_masks_equal_the_serial_fills(compiler, tokenizer) -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    overlapped, serial = compiler.compile(spec), _serial(compiler, spec)
    rng = random.Random(0)
    steps = 0
    while not serial.is_done and steps < 64:  # a random walk through the grammar
        overlapped.prefetch()
        expected = serial.bitmask().clone()
        assert torch.equal(overlapped.bitmask(), expected)
        token = rng.choice(_allowed(expected))
        assert overlapped.accept(token) and serial.accept(token)
        steps += 1
    assert steps > 3 and overlapped.is_done == serial.is_done


def test_one_round_of_several_matchers_gives_each_its_own_mask(compiler, tokenizer) -> None:
    filler = MaskFiller("test-fill")
    gate = threading.Event()
    blocker = GrammarMatcher(GatedLLMatcher(gate), 64, filler)  # type: ignore[arg-type]
    blocker.prefetch()
    assert blocker.llguidance_matcher.started.wait(WAIT_S)
    spec = GrammarSpec.json_schema(SCHEMA)
    rng = random.Random(1)
    pairs = []
    for length in (0, 2, 4, 7, 11):  # queued behind the blocker: filled together in one round
        m = GrammarMatcher(compiler.compile(spec).llguidance_matcher, compiler.vocab_size, filler)
        ref = _serial(compiler, spec)
        for _ in range(length):  # each at its own point of the grammar
            token = rng.choice(_allowed(ref.bitmask()))
            assert m.accept(token) and ref.accept(token)
        m.prefetch()
        pairs.append((m, ref))
    gate.set()
    for m, ref in pairs:
        assert torch.equal(m.bitmask(), ref.bitmask())
    assert filler._executor is not None  # the round went to llguidance's parallel executor
    assert _allowed(blocker.bitmask()) == [0]


def test_a_failed_fill_fails_its_matcher_only(compiler, tokenizer) -> None:
    filler = MaskFiller("test-fill")
    gate = threading.Event()
    vocab = compiler.vocab_size
    blocker = GrammarMatcher(GatedLLMatcher(gate), vocab, filler)  # type: ignore[arg-type]
    blocker.prefetch()
    assert blocker.llguidance_matcher.started.wait(WAIT_S)
    spec = GrammarSpec("regex", "ab+")
    failing = GrammarMatcher(GatedLLMatcher(fails=True), vocab, filler)  # type: ignore[arg-type]
    healthy = GrammarMatcher(compiler.compile(spec).llguidance_matcher, vocab, filler)
    failing.prefetch()
    healthy.prefetch()  # one round with the failing one (the executor refuses the double)
    gate.set()
    assert (failing.bitmask() == -1).all()  # everything allowed: the step samples as usual
    assert not failing.accept(0)
    assert "bitmask fill failed: parser exploded" in (failing.error or "")
    assert torch.equal(healthy.bitmask(), _serial(compiler, spec).bitmask())
    token = _allowed(healthy.bitmask())[0]
    assert healthy.accept(token) and healthy.error is None


def test_accept_waits_for_the_fill_that_owns_the_state() -> None:
    gate = threading.Event()
    llm = GatedLLMatcher(gate)
    matcher = GrammarMatcher(llm, 64, MaskFiller("test-fill"))  # type: ignore[arg-type]
    matcher.prefetch()
    assert llm.started.wait(WAIT_S)
    accepted = threading.Event()
    thread = threading.Thread(target=lambda: matcher.accept(0) and accepted.set())
    thread.start()
    assert not accepted.wait(0.2)  # still filling: the accept does not touch the state
    gate.set()
    thread.join(WAIT_S)
    assert accepted.is_set() and llm.calls == ["fill", "consume"]


def test_a_wedged_fill_allows_everything_then_fails_its_request(monkeypatch) -> None:
    monkeypatch.setattr(matcher_module, "FILL_TIMEOUT_S", 0.05)
    gate = threading.Event()  # never set while the matcher waits: the fill is wedged
    llm = GatedLLMatcher(gate)
    matcher = GrammarMatcher(llm, 64, MaskFiller("test-fill"))  # type: ignore[arg-type]
    matcher.prefetch()
    assert llm.started.wait(WAIT_S)
    try:
        assert (matcher.bitmask() == -1).all()  # the step samples as if unconstrained
        assert "bitmask fill took over" in (matcher.error or "")
        assert not matcher.accept(0)  # and the request fails at its accept
        assert "consume" not in llm.calls  # the state was never touched while the fill owned it
    finally:
        gate.set()  # let the filler's thread go


def test_prefetch_fills_once_per_state_and_never_after_the_end(compiler, tokenizer) -> None:
    submitted: list[GrammarMatcher] = []

    class CountingFiller(MaskFiller):
        def submit(self, matchers: list[GrammarMatcher]) -> None:
            submitted.extend(matchers)
            super().submit(matchers)

    filler = CountingFiller("test-fill")
    m = GrammarMatcher(
        compiler.compile(GrammarSpec("regex", "ab")).llguidance_matcher, compiler.vocab_size, filler
    )
    m.prefetch()
    m.prefetch()  # in flight or known: nothing more
    m.bitmask()
    m.prefetch()
    assert len(submitted) == 1
    assert m.accept(tokenizer.token_to_id("a"))
    m.prefetch()
    assert len(submitted) == 2
    assert m.accept(tokenizer.token_to_id("b")) and m.is_done
    m.prefetch()  # complete: no next mask to compute
    assert len(submitted) == 2


def test_prefetch_all_hands_the_due_matchers_over_at_once(compiler) -> None:
    rounds: list[int] = []

    class CountingFiller(MaskFiller):
        def submit(self, matchers: list[GrammarMatcher]) -> None:
            rounds.append(len(matchers))
            super().submit(matchers)

    filler = CountingFiller("test-fill")
    spec = GrammarSpec("regex", "[ab]{3}")
    matchers = [
        GrammarMatcher(compiler.compile(spec).llguidance_matcher, compiler.vocab_size, filler)
        for _ in range(3)
    ]
    matchers[0].bitmask()  # known already: not due
    prefetch_all(matchers)
    assert rounds == [2]
    reference = _serial(compiler, spec).bitmask()
    assert all(torch.equal(m.bitmask(), reference) for m in matchers)
