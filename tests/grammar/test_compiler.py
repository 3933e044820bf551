"""Grammar compilation: specs -> matchers, the LRU cache, errors and the timeout."""

from __future__ import annotations

import pytest

from pdserve.grammar import GrammarCompiler, GrammarError, GrammarSpec
from pdserve.grammar.compiler import GrammarLimits, validate_spec
from pdserve.model.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _accepts(compiler: GrammarCompiler, tokenizer: Tokenizer, spec: GrammarSpec, text: str):
    matcher = compiler.compile(spec)
    return matcher.accept_all(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_done


def test_each_kind_compiles_and_matches_what_it_describes(compiler, tokenizer) -> None:
    assert _accepts(compiler, tokenizer, GrammarSpec.json_schema(SCHEMA), '{"a":12}')
    assert not _accepts(compiler, tokenizer, GrammarSpec.json_schema(SCHEMA), '{"b":1}')
    assert _accepts(compiler, tokenizer, GrammarSpec("json_object"), '{"x":[1,2]}')
    assert _accepts(compiler, tokenizer, GrammarSpec("regex", "[0-9]{3}"), "123")
    assert _accepts(
        compiler, tokenizer, GrammarSpec("grammar", 'start: "x" ("y" | "z") "y"'), "xzy"
    )
    gbnf = GrammarSpec("grammar", 'root ::= "a" digit+ \ndigit ::= [0-9]')
    assert _accepts(compiler, tokenizer, gbnf, "a42") is False  # digit+ may go on: not done
    assert compiler.compile(gbnf).accept_all(tokenizer.encode("a42", add_special_tokens=False))
    choice = GrammarSpec.choice(['say "hi"', "a|b", "ü"])
    assert _accepts(compiler, tokenizer, choice, 'say "hi"')
    assert _accepts(compiler, tokenizer, choice, "a|b")
    assert not _accepts(compiler, tokenizer, choice, "a")


def test_same_schema_in_other_key_order_is_one_cache_entry(compiler, tokenizer) -> None:
    one = GrammarSpec.json_schema({"type": "object", "required": ["a"]})
    two = GrammarSpec.json_schema({"required": ["a"], "type": "object"})
    assert one == two
    first, second = compiler.compile(one), compiler.compile(two)
    assert len(compiler._cache) == 1
    # Each stream owns its state: advancing one leaves the other at the start.
    assert first.accept_all(tokenizer.encode('{"a":', add_special_tokens=False))
    assert not second.accept_all(tokenizer.encode("1", add_special_tokens=False))


def test_cache_is_bounded_lru(tokenizer) -> None:
    compiler = GrammarCompiler(
        tokenizer.backend.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids,
        GrammarLimits(cache_size=2),
    )  # fmt: skip
    for pattern in ("a", "b", "a", "c"):
        compiler.compile(GrammarSpec("regex", pattern))
    assert list(compiler._cache) == [GrammarSpec("regex", "a"), GrammarSpec("regex", "c")]


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.json_schema({"type": "nonsense"}),
        GrammarSpec("regex", "a("),
        GrammarSpec("grammar", "start: missing_rule"),
        GrammarSpec("grammar", "root ::= undefined_rule"),
    ],
)
def test_invalid_specs_raise_grammar_error(compiler, spec: GrammarSpec) -> None:
    with pytest.raises(GrammarError):
        compiler.compile(spec)
    with pytest.raises(GrammarError):
        validate_spec(spec)


async def test_compile_async_runs_off_the_loop_and_times_out(tokenizer) -> None:
    slow = GrammarCompiler(
        tokenizer.backend.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids,
        GrammarLimits(compile_timeout_s=1e-6),
    )  # fmt: skip
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    with pytest.raises(GrammarError, match="longer than"):
        await slow.compile_async(GrammarSpec.json_schema(big))
    fast = GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size,
                           tokenizer.eos_token_ids)  # fmt: skip
    matcher = await fast.compile_async(GrammarSpec("regex", "x"))
    assert matcher.error is None
