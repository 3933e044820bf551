"""Structured-output request fields -> one :class:`~pdserve.grammar.GrammarSpec` (or none).

Accepted, as in vLLM: OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``),
the extra fields ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
(Lark, or GBNF ``root ::= ...`` as vLLM and llama.cpp write it), and the newer
``structured_outputs`` object with keys ``json``, ``regex``, ``choice``, ``grammar``,
``json_object``. At most one constraint per request; every failure is a 400 naming the field.
Compilation (and its own errors) happens in :mod:`pdserve.api.grammar_service`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import orjson

from pdserve.api.errors import bad_request, unrecognized_argument, unsupported
from pdserve.api.validation import as_bool, as_list, as_object, as_str, optional, require
from pdserve.grammar.spec import GrammarSpec

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# Accepted and without effect here: the backend is always llguidance.
GUIDED_IGNORED = frozenset({"guided_decoding_backend"})
_STRUCTURED_KEYS = {
    "json": "guided_json",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
}
MAX_CHOICES = 256


@dataclass(frozen=True, slots=True)
class Constraint:
    """The request's grammar and the field it came from (named by compile errors)."""

    spec: GrammarSpec
    param: str
    label: str = ""  # what the field holds, for errors: "function 'get_weather'"
    # Pieces compiled alone to name the culprit when the whole fails (required's tools).
    parts: tuple[Constraint, ...] = ()


def allowing_extra_keys(constraint: Constraint | None, allow: bool) -> Constraint | None:
    """``constraint`` under the server's reading of schemas that do not say
    ``additionalProperties`` (see :class:`~pdserve.grammar.spec.GrammarSpec`)."""
    if constraint is None or not allow or constraint.spec.kind != "json_schema":
        return constraint
    spec = dataclasses.replace(constraint.spec, allow_extra_keys=True)
    parts = tuple(p for c in constraint.parts if (p := allowing_extra_keys(c, allow)) is not None)
    return dataclasses.replace(constraint, spec=spec, parts=parts)


def parse_constraint(body: dict[str, Any], max_chars: int) -> Constraint | None:
    """The one structured-output constraint of ``body``, validated in shape and size."""
    found: list[Constraint] = []
    response_format = body.get("response_format")
    if response_format is not None:
        spec = _response_format(response_format, max_chars)
        if spec is not None:
            found.append(Constraint(spec, "response_format"))
    for name in GUIDED_FIELDS:
        if body.get(name) is not None:
            found.append(Constraint(_guided(name, body[name], name, max_chars), name))
    structured = body.get("structured_outputs")
    if structured is not None:
        found.extend(_structured_outputs(structured, max_chars))
    if len(found) > 1:
        names = ", ".join(f"'{c.param}'" for c in found)
        raise bad_request(
            f"Only one structured-output constraint per request; got {names}.",
            param=found[1].param,
        )
    return found[0] if found else None


def _response_format(value: Any, max_chars: int) -> GrammarSpec | None:
    obj = as_object(value, "response_format")
    kind = as_str(require(obj, "type", "response_format.type"), "response_format.type")
    if kind == "text":
        _only_keys(obj, {"type"}, "response_format")
        return None
    if kind == "json_object":
        _only_keys(obj, {"type"}, "response_format")
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise bad_request(
            f"Invalid value for 'response_format.type': '{kind}'. Supported values are: "
            "'text', 'json_object' and 'json_schema'.",
            param="response_format.type",
        )
    _only_keys(obj, {"type", "json_schema"}, "response_format")
    param = "response_format.json_schema"
    inner = as_object(require(obj, "json_schema", param), param)
    _only_keys(inner, {"name", "schema", "strict", "description"}, param)
    as_str(require(inner, "name", f"{param}.name"), f"{param}.name", 64, non_empty=True)
    as_bool(optional(inner, "strict", False), f"{param}.strict")
    if inner.get("description") is not None:
        as_str(inner["description"], f"{param}.description")
    # OpenAI: a json_schema without a schema means any JSON object.
    schema = inner.get("schema")
    if schema is None:
        return GrammarSpec("json_object")
    return _schema_spec(schema, f"{param}.schema", max_chars)


def _only_keys(obj: dict[str, Any], allowed: set[str], param: str) -> None:
    for key in obj:
        if key not in allowed:
            raise unrecognized_argument(f"{param}.{key}")


def _schema_spec(schema: Any, param: str, max_chars: int) -> GrammarSpec:
    if isinstance(schema, str):  # vLLM accepts a schema as a JSON string too
        _check_size(schema, param, max_chars)
        try:
            schema = orjson.loads(schema)
        except orjson.JSONDecodeError as exc:
            raise bad_request(f"'{param}' is not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, dict | bool):
        raise bad_request(f"'{param}' must be a JSON schema object.", param=param)
    spec = GrammarSpec.json_schema(schema)
    _check_size(spec.source, param, max_chars)
    return spec


def _check_size(text: str, param: str, max_chars: int) -> None:
    if len(text) > max_chars:
        raise bad_request(
            f"'{param}' is too large: {len(text)} characters, the maximum is {max_chars}.",
            param=param,
        )


def _guided(name: str, value: Any, param: str, max_chars: int) -> GrammarSpec:
    if name == "guided_json":
        return _schema_spec(value, param, max_chars)
    if name == "guided_choice":
        items = as_list(value, param, non_empty=True)
        if len(items) > MAX_CHOICES:
            raise bad_request(
                f"'{param}' has {len(items)} choices, the maximum is {MAX_CHOICES}.", param=param
            )
        choices = [as_str(c, f"{param}[{i}]", non_empty=True) for i, c in enumerate(items)]
        spec = GrammarSpec.choice(choices)
        _check_size(spec.source, param, max_chars)
        return spec
    text = as_str(value, param, non_empty=True)
    _check_size(text, param, max_chars)
    return GrammarSpec("regex" if name == "guided_regex" else "grammar", text)


def _structured_outputs(value: Any, max_chars: int) -> list[Constraint]:
    obj = as_object(value, "structured_outputs")
    found = []
    for key, item in obj.items():
        param = f"structured_outputs.{key}"
        if item is None:
            continue
        if key in _STRUCTURED_KEYS:
            found.append(Constraint(_guided(_STRUCTURED_KEYS[key], item, param, max_chars), param))
        elif key == "json_object":
            if as_bool(item, param):
                found.append(Constraint(GrammarSpec("json_object"), param))
        elif key in ("structural_tag", "whitespace_pattern"):
            raise unsupported(param, f"'{key}' is not available")
        elif key not in ("disable_any_whitespace", "disable_additional_properties"):
            raise unrecognized_argument(param)
    return found
