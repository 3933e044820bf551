"""GrammarSpec: schemas keep their key order; undeclared keys are closed by default."""

from __future__ import annotations

import json

from pdserve.grammar.spec import GrammarSpec, close_objects

PERSON = {
    "type": "object",
    "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "string"}},
    "required": ["zeta", "alpha"],
}


def test_schema_text_keeps_the_declared_key_order() -> None:
    spec = GrammarSpec.json_schema(PERSON)
    assert list(json.loads(spec.schema_text())["properties"]) == ["zeta", "alpha"]
    reordered = {**PERSON, "properties": {"alpha": {"type": "string"}, "zeta": {"type": "integer"}}}
    assert GrammarSpec.json_schema(reordered) != spec  # another order is another grammar


def test_objects_without_additional_properties_are_closed_by_default() -> None:
    nested = {
        **PERSON,
        "properties": {**PERSON["properties"], "pet": PERSON},
        "$defs": {"P": PERSON},
    }
    closed = json.loads(GrammarSpec.json_schema(nested).schema_text())
    assert closed["additionalProperties"] is False
    assert closed["properties"]["pet"]["additionalProperties"] is False
    assert closed["$defs"]["P"]["additionalProperties"] is False
    opened = json.loads(GrammarSpec.json_schema(nested, allow_extra_keys=True).schema_text())
    assert "additionalProperties" not in opened


def test_what_a_schema_says_about_extra_keys_is_kept() -> None:
    free = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert close_objects(free) == free
    open_map = {"type": "object"}  # declares no properties: a free-form map stays one
    assert close_objects(open_map) == open_map


def test_all_of_members_stay_open() -> None:
    schema = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    out = close_objects(schema)
    assert all("additionalProperties" not in m for m in out["allOf"])
