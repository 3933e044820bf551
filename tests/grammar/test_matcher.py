"""A matcher's bitmask row allows exactly the tokens its grammar can take next."""

from __future__ import annotations

from pdserve.grammar import GrammarSpec
from pdserve.grammar.matcher import bitmask_words
from pdserve.kernels.logits_processors import unpack_bitmask


def _allowed(matcher, vocab: int) -> set[int]:
    row = matcher.bitmask()
    assert row.shape == (bitmask_words(vocab),)
    return set(unpack_bitmask(row.unsqueeze(0), vocab)[0].nonzero().flatten().tolist())


def test_bitmask_follows_the_grammar_as_tokens_are_accepted(compiler, tokenizer) -> None:
    vocab = tokenizer.vocab_size
    matcher = compiler.compile(GrammarSpec("regex", "(ab|ac)d"))
    first = _allowed(matcher, vocab)
    a = tokenizer.token_to_id("a")
    assert a in first and tokenizer.token_to_id("b") not in first
    assert all(tokenizer.decode([t]).startswith("a") for t in first)
    assert matcher.accept(a)
    after_a = {tokenizer.decode([t]) for t in _allowed(matcher, vocab)}
    assert "b" in after_a and "c" in after_a and "d" not in after_a
    assert matcher.accept(tokenizer.token_to_id("c")) and not matcher.is_done
    assert matcher.accept(tokenizer.token_to_id("d")) and matcher.is_done
    # Complete: only EOS may follow.
    assert _allowed(matcher, vocab) <= set(tokenizer.eos_token_ids)


def test_a_rejected_token_puts_the_matcher_in_error(compiler, tokenizer) -> None:
    matcher = compiler.compile(GrammarSpec("regex", "x+"))
    assert not matcher.accept(tokenizer.token_to_id("y"))
    assert matcher.error is not None
