"""The worker's grammar service: matchers per choice, and 400s that name the field."""

from __future__ import annotations

import pytest

from pdserve.api.errors import ApiError
from pdserve.api.grammar_service import GrammarService
from pdserve.api.structured import Constraint
from pdserve.grammar import GrammarSpec
from pdserve.model.demo import write_demo_model
from pdserve.model.tokenizer import Tokenizer

from .engine_double import ByteTokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_demo_model(tmp_path_factory.mktemp("demo")))


async def test_each_choice_gets_its_own_matcher(tokenizer: Tokenizer) -> None:
    service = GrammarService(tokenizer)
    constraint = Constraint(GrammarSpec("regex", "ab"), "guided_regex")
    first, second, third = await service.matchers(constraint, 3)
    assert first.accept(tokenizer.token_to_id("a"))
    # The others still start at the beginning.
    assert not second.accept(tokenizer.token_to_id("b"))
    assert third.accept(tokenizer.token_to_id("a"))


async def test_a_bad_grammar_is_a_400_naming_its_field(tokenizer: Tokenizer) -> None:
    service = GrammarService(tokenizer)
    with pytest.raises(ApiError) as info:
        await service.matchers(
            Constraint(GrammarSpec("regex", "(("), "structured_outputs.regex"), 1
        )
    assert info.value.status == 400 and info.value.param == "structured_outputs.regex"
    assert "regex" in info.value.message


async def test_a_tokenizer_without_tokenizer_json_refuses_by_field() -> None:
    service = GrammarService(ByteTokenizer())
    with pytest.raises(ApiError) as info:
        await service.matchers(Constraint(GrammarSpec("json_object"), "response_format"), 1)
    assert info.value.status == 400 and info.value.param == "response_format"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "bad"}}])
async def test_a_tool_schema_that_cannot_compile_is_a_400_naming_the_function(
    tokenizer: Tokenizer, choice: object
) -> None:
    from pdserve.api.config import ApiConfig
    from pdserve.api.tools import parse_tools

    good = {"type": "object", "properties": {"x": {"type": "string"}}}
    bad = {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}
    tools = [
        {"type": "function", "function": {"name": "good", "parameters": good}},
        {"type": "function", "function": {"name": "bad", "parameters": bad}},
    ]
    config = parse_tools({"tools": tools, "tool_choice": choice}, ApiConfig("m"))
    assert config is not None
    constraint = config.constraint()
    assert constraint is not None
    with pytest.raises(ApiError) as info:
        await GrammarService(tokenizer).matchers(constraint, 1)
    assert info.value.status == 400 and info.value.param == "tools[1].function.parameters"
    assert "function 'bad'" in info.value.message and "missing" in info.value.message
