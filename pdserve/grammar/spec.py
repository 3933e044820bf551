"""What a request constrains its output to, independent of the grammar engine's types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import orjson

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# Any JSON object: what response_format {"type": "json_object"} promises.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One constraint, hashable (the compiler caches by it).

    ``source`` is the schema as canonical JSON text (json_schema), the regex, the Lark grammar,
    or the choices as a JSON array of strings (choice); empty for json_object.
    """

    kind: GrammarKind
    source: str = ""

    @classmethod
    def json_schema(cls, schema: object) -> GrammarSpec:
        # Canonical text: the same schema sent with other key order or spacing hits the cache.
        return cls("json_schema", orjson.dumps(schema, option=orjson.OPT_SORT_KEYS).decode())

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls("choice", orjson.dumps(choices).decode())

    def schema_text(self) -> str:
        """The JSON schema this spec compiles (json_schema and json_object only)."""
        return _ANY_OBJECT_SCHEMA if self.kind == "json_object" else self.source

    def choice_lark(self) -> str:
        """A Lark grammar matching exactly one of the choices (choice only)."""
        choices: list[str] = orjson.loads(self.source)
        # JSON string literals are Lark string literals (same escapes).
        return "start: " + " | ".join(orjson.dumps(c).decode() for c in choices)
