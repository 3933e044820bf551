"""Structured-output fields -> one GrammarSpec, and 400s that name the field."""

from __future__ import annotations

import pytest

from pdserve.api.errors import ApiError
from pdserve.api.structured import parse_constraint
from pdserve.grammar import GrammarSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("body", "spec", "param"),
    [
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object"),
         "response_format"),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
            GrammarSpec.json_schema(SCHEMA), "response_format",
        ),
        ({"guided_json": SCHEMA}, GrammarSpec.json_schema(SCHEMA), "guided_json"),
        ({"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}}'},
         GrammarSpec.json_schema(SCHEMA), "guided_json"),
        ({"guided_regex": "[a-z]+"}, GrammarSpec("regex", "[a-z]+"), "guided_regex"),
        ({"guided_choice": ["x", "y"]}, GrammarSpec.choice(["x", "y"]), "guided_choice"),
        ({"guided_grammar": 'start: "a"'}, GrammarSpec("grammar", 'start: "a"'), "guided_grammar"),
        ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec.json_schema(SCHEMA),
         "structured_outputs.json"),
        ({"structured_outputs": {"choice": ["p"]}}, GrammarSpec.choice(["p"]),
         "structured_outputs.choice"),
        ({"structured_outputs": {"json_object": True}}, GrammarSpec("json_object"),
         "structured_outputs.json_object"),
    ],
)  # fmt: skip
def test_each_accepted_shape_gives_its_spec(body: dict, spec: GrammarSpec | None, param) -> None:
    constraint = parse_constraint(body, 10_000)
    if spec is None:
        assert constraint is None
    else:
        assert constraint is not None and constraint.spec == spec and constraint.param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
         "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "n", "schema": [1]}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "text", "extra": 1}}, "response_format.extra"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": {"x": "y" * 20_000}}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_choice": "x"}, "guided_choice"),
        ({"guided_choice": ["x", 3]}, "guided_choice[1]"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs.regex"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"frob": 1}}, "structured_outputs.frob"),
    ],
)  # fmt: skip
def test_bad_shapes_are_400s_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_constraint(body, 10_000)
    assert info.value.status == 400 and info.value.param == param
