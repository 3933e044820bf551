"""Endings inside an accepted run end the stream where the plain stream ends (max_tokens, a stop
token, a stop string, min_tokens holding a stop back), a structured output among drafting
requests keeps its meaning, and every page comes back (the harness checks the idle gauges)."""

from __future__ import annotations

from pdserve.grammar import GrammarCompiler, GrammarSpec
from pdserve.model_runner import ModelRunner

from .harness import both, greedy, seeded
from .test_engine_ngram import CODE, NGRAM, biased


def repeating(runner: ModelRunner) -> list[int]:
    return runner.tokenizer.encode(CODE * 3)


def test_max_tokens_inside_a_run(target: ModelRunner) -> None:
    ids = repeating(target)
    for n in range(1, 10):
        plain, seen, stats = both(target, [(ids, greedy(n, ignore_eos=True))], NGRAM)
        assert seen == plain and len(seen[0].ids) == n
    assert stats.accepted_tokens > 0


def _plain_ids(runner: ModelRunner, ids: list[int], n: int) -> list[int]:
    plain, _, _ = both(runner, [(ids, greedy(n, ignore_eos=True))], NGRAM)
    return list(plain[0].ids)


def test_stop_token_inside_a_run(target: ModelRunner) -> None:
    tok = target.tokenizer
    for text in (CODE * 3, "class Page:\n    pass\n" * 4):
        ids = tok.encode(text)
        out = _plain_ids(target, ids, 16)
        for stop in sorted(set(out[1:]))[:4]:
            sp = greedy(16, stop_token_ids=[stop])
            plain, seen, _ = both(target, [(ids, sp)], NGRAM)
            assert seen == plain and seen[0].finish == "stop"
            held = greedy(16, stop_token_ids=[stop], min_tokens=5)
            plain, seen, _ = both(target, [(ids, held)], NGRAM)
            assert seen == plain


def test_stop_string_inside_a_run(target: ModelRunner) -> None:
    ids = repeating(target)
    sp0 = seeded(20, 3, ignore_eos=True, logit_bias=biased(ids))
    plain, _, _ = both(target, [(ids, sp0)], NGRAM)
    text = plain[0].text
    assert len(text) > 8
    for cut in (3, len(text) // 2, len(text) - 2):
        stop = text[cut : cut + 2]
        if not stop.strip():
            continue
        for keep in (False, True):
            sp = seeded(20, 3, ignore_eos=True, logit_bias=biased(ids), stop=[stop],
                        include_stop_str_in_output=keep)  # fmt: skip
            plain, seen, _ = both(target, [(ids, sp)], NGRAM)
            assert seen == plain and seen[0].finish == "stop"


def test_json_schema_request_among_drafting_ones(target: ModelRunner) -> None:
    tok = target.tokenizer
    compiler = GrammarCompiler(tok.backend.to_str(), tok.vocab_size, tok.eos_token_ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def matcher() -> object:
        return compiler.compile(GrammarSpec.json_schema(schema))

    ids = repeating(target)
    reqs = [
        (ids, greedy(24)),
        (ids, greedy(30), matcher),
        (ids, seeded(24, 5, logit_bias=biased(ids))),
        (ids, seeded(30, 6), matcher),
    ]
    plain, seen, stats = both(target, reqs, NGRAM)
    assert seen == plain
    assert stats.accepted_tokens > 0


def test_json_schema_request_drafts_and_keeps_its_grammar(target: ModelRunner) -> None:
    """A structured output drafts: each verify row is masked by its matcher advanced through
    the drafts (then rolled back). A prompt holding the plain answer makes n-gram drafts of
    it, so runs are accepted; greedy and seeded, the stream is the plain one."""
    tok = target.tokenizer
    compiler = GrammarCompiler(tok.backend.to_str(), tok.vocab_size, tok.eos_token_ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a", "b"]}  # fmt: skip

    def matcher() -> object:
        return compiler.compile(GrammarSpec.json_schema(schema))

    ids = repeating(target)
    for sp in (greedy(40), seeded(40, 9)):
        plain, _, _ = both(target, [(ids, sp, matcher)], NGRAM)
        answer = list(plain[0].ids)
        prompt = ids + answer[:-1] * 2  # the answer, twice, without its EOS
        plain, seen, stats = both(target, [(prompt, sp, matcher)], NGRAM)
        assert seen == plain
        assert stats.accepted_tokens > 0


def test_penalties_top_k_and_min_p_see_the_drafts_as_output(target: ModelRunner) -> None:
    """Each verify row's penalties count the drafts before it as generated tokens, as the plain
    step there would (its history is those tokens); top-k, min-p and logit bias per row too."""
    ids = repeating(target)
    bias = biased(ids)
    reqs = [
        (ids, greedy(20, ignore_eos=True, repetition_penalty=1.3, logit_bias=bias)),
        (ids, seeded(20, 1, ignore_eos=True, frequency_penalty=0.7, presence_penalty=0.4,
                     logit_bias=bias)),
        (ids, seeded(20, 2, ignore_eos=True, top_k=5, min_p=0.05, logit_bias=bias)),
    ]  # fmt: skip
    plain, seen, stats = both(target, reqs, NGRAM)
    assert seen == plain
    assert stats.draft_tokens > 0
