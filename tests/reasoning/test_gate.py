"""The token gate: where generation starts, the grammar asleep while thinking and woken after
the end-of-thinking token (which it is never fed), and the budget's forced end."""

from __future__ import annotations

import torch

from pdserve.kernels.logits_processors import logits_processing_for
from pdserve.reasoning.gate import ReasoningSpec, ThinkingState, grammar_sees, starts_thinking
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence

START, END, SPACE, WORD = 10, 11, 1, 2


def _text(token: int) -> str:
    return {START: "<think>", END: "</think>", SPACE: "\n\n"}.get(token, "word")


class RecordingGrammar:
    """Stands in for a GrammarMatcher: records what it is fed."""

    is_done = False
    error = None

    def __init__(self) -> None:
        self.fed: list[int] = []

    def accept(self, token: int) -> bool:
        self.fed.append(token)
        return True


def test_the_prompts_last_tag_says_where_generation_starts() -> None:
    assert starts_thinking([WORD, START, SPACE], START, END, _text) is True  # R1: opened
    assert starts_thinking([WORD, START, SPACE, END, SPACE], START, END, _text) is False
    assert starts_thinking([WORD, END, WORD, WORD], START, END, _text) is True  # an old turn
    assert starts_thinking([WORD], START, END, _text, default=False) is False


def _seq(spec: ReasoningSpec, grammar: RecordingGrammar | None = None) -> Sequence:
    seq = Sequence("s", [WORD, WORD], 2, SamplingParams())
    seq.grammar = grammar  # type: ignore[assignment]
    ThinkingState.attach(seq, spec)
    return seq


def _commit(seq: Sequence, token: int) -> None:
    """What the engine does with a sampled token (step_output._apply_rows)."""
    seq.token_ids.append(token)
    if grammar_sees(seq, token) and seq.grammar is not None:
        seq.grammar.accept(token)


def test_the_grammar_sleeps_through_the_block_and_starts_after_its_end() -> None:
    grammar = RecordingGrammar()
    seq = _seq(ReasoningSpec(START, END, is_thinking=True), grammar)
    assert seq.grammar is None  # no mask while thinking
    for token in (START, WORD, WORD, SPACE):
        _commit(seq, token)
    assert grammar.fed == [] and seq.grammar is None
    _commit(seq, END)
    assert seq.grammar is grammar and grammar.fed == []  # awake; the closing tag not fed
    for token in (WORD, SPACE):
        _commit(seq, token)
    assert grammar.fed == [WORD, SPACE]


def test_a_prompt_that_closed_the_block_leaves_the_grammar_on_from_the_start() -> None:
    grammar = RecordingGrammar()
    seq = _seq(ReasoningSpec(START, END, is_thinking=False, max_tokens=0), grammar)
    assert seq.grammar is grammar
    _commit(seq, WORD)
    assert grammar.fed == [WORD] and not seq.reasoning.must_end


def test_the_budget_forces_the_end_token_once_spent() -> None:
    seq = _seq(ReasoningSpec(START, END, is_thinking=True, max_tokens=2))
    state = seq.reasoning
    _commit(seq, START)  # an opening tag is no thinking text
    _commit(seq, WORD)
    assert not state.must_end
    _commit(seq, WORD)
    assert state.must_end
    logits = torch.randn(2, 16)
    other = _seq(ReasoningSpec(START, END, is_thinking=True, max_tokens=5))
    before = logits[1].clone()
    processing = logits_processing_for([seq, other], frozenset(), torch.device("cpu"))
    assert processing is not None
    out = processing.apply(logits)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [END]  # only </think>
    assert torch.equal(out[1], before)  # a row with budget left is untouched
    _commit(seq, END)
    assert not state.must_end
    assert logits_processing_for([seq], frozenset(), torch.device("cpu")) is None


def test_a_zero_budget_ends_the_block_at_the_first_token() -> None:
    seq = _seq(ReasoningSpec(START, END, is_thinking=True, max_tokens=0))
    assert seq.reasoning.must_end
