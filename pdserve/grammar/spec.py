"""What a request constrains its output to, independent of the grammar engine's types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# Any JSON object: what response_format {"type": "json_object"} promises.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One constraint, hashable (the compiler caches by it).

    ``source`` is the schema as compact JSON text (json_schema), the regex, the Lark grammar,
    or the choices as a JSON array of strings (choice); empty for json_object.

    A schema keeps its properties' order: the output's keys come in the order they are declared
    (users put reasoning before the answer on purpose), as vLLM, xgrammar and OpenAI do. Every
    other key is sorted, so the same schema written with its keywords in another order is the
    same spec (one compile); other property order is another spec, and another grammar.

    ``allow_extra_keys``: JSON Schema's own reading, where an object that does not say
    ``additionalProperties`` may hold undeclared keys. Off by default, as in vLLM's default
    (xgrammar's strict mode): objects that declare ``properties`` and say nothing of
    ``additionalProperties`` get ``false``, so a weak model cannot wander into a key the schema
    never named (pydantic, instructor and langchain schemas never say it).
    """

    kind: GrammarKind
    source: str = ""
    allow_extra_keys: bool = False

    @classmethod
    def json_schema(cls, schema: object, allow_extra_keys: bool = False) -> GrammarSpec:
        text = orjson.dumps(_canonical(schema)).decode()
        return cls("json_schema", text, allow_extra_keys)

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls("choice", orjson.dumps(choices).decode())

    def schema_text(self) -> str:
        """The JSON schema this spec compiles (json_schema and json_object only)."""
        if self.kind == "json_object":
            return _ANY_OBJECT_SCHEMA
        if self.allow_extra_keys:
            return self.source
        return orjson.dumps(close_objects(orjson.loads(self.source))).decode()

    def choice_lark(self) -> str:
        """A Lark grammar matching exactly one of the choices (choice only)."""
        choices: list[str] = orjson.loads(self.source)
        # JSON string literals are Lark string literals (same escapes).
        return "start: " + " | ".join(orjson.dumps(c).decode() for c in choices)


# Values taken as JSON data, not schemas: their key order is the data's.
_LITERALS = ("const", "enum", "default", "examples")


def _canonical(schema: Any) -> Any:
    """Keywords sorted at every level, except the order of ``properties`` (and literals)."""
    if isinstance(schema, list):
        return [_canonical(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key in sorted(schema):
        value = schema[key]
        if key in _LITERALS:
            out[key] = value
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _canonical(v) for name, v in value.items()}
        else:
            out[key] = _canonical(value)
    return out


# Keywords whose values are schemas (or maps/lists of schemas) that close_objects walks into.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalItems", "not", "if", "then", "else", "contains")


def close_objects(schema: Any, in_all_of: bool = False) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that declares
    ``properties`` and says nothing about extra keys (a copy; key order kept).

    Direct members of an ``allOf`` are left open: each names only part of the keys, and
    closing them would forbid the keys the other members declare.
    """
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: close_objects(v) for k, v in value.items()}
        elif key in _SCHEMA_LISTS or key in _SCHEMA_VALUES:
            out[key] = close_objects(value)
        elif key == "allOf" and isinstance(value, list):
            out[key] = [close_objects(s, in_all_of=True) for s in value]
        elif key == "additionalProperties" and isinstance(value, dict):
            out[key] = close_objects(value)
        else:
            out[key] = value
    is_open = "additionalProperties" not in out and "unevaluatedProperties" not in out
    if isinstance(out.get("properties"), dict) and is_open and not in_all_of:
        out["additionalProperties"] = False
    return out
