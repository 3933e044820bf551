"""Explicit type checks for decoded JSON: every failure is a 400 that names the offending field.

JSON ``null`` counts as "not given" for optional fields (what OpenAI clients send for defaults).
``bool`` is never accepted where a number is expected, although Python treats it as an int.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

from pdserve.api.errors import ApiError, bad_request

T = TypeVar("T")


def type_error(param: str, expected: str, value: Any) -> ApiError:
    return bad_request(
        f"Invalid type for '{param}': expected {expected}, but got {json_type_name(value)}.",
        param=param,
        code="invalid_type",
    )


def json_type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_int(
    value: Any, param: str, min_value: int | None = None, max_value: int | None = None
) -> int:
    """``value`` as an int in ``[min_value, max_value]`` (bounds inclusive)."""
    if not is_int(value):
        raise type_error(param, "an integer", value)
    if min_value is not None and value < min_value:
        raise bad_request(f"'{param}' must be >= {min_value}, got {value}.", param=param)
    if max_value is not None and value > max_value:
        raise bad_request(f"'{param}' must be <= {max_value}, got {value}.", param=param)
    return value


def as_float(
    value: Any,
    param: str,
    min_value: float | None = None,
    max_value: float | None = None,
    min_exclusive: bool = False,
) -> float:
    """``value`` as a finite float; ints are accepted (JSON has one number type), bools are not."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise type_error(param, "a number", value)
    number = float(value)
    if not math.isfinite(number):
        raise bad_request(f"'{param}' must be a finite number, got {number}.", param=param)
    if min_value is not None and (number < min_value or (min_exclusive and number == min_value)):
        op = ">" if min_exclusive else ">="
        raise bad_request(f"'{param}' must be {op} {min_value}, got {number}.", param=param)
    if max_value is not None and number > max_value:
        raise bad_request(f"'{param}' must be <= {max_value}, got {number}.", param=param)
    return number


def as_bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise type_error(param, "a boolean", value)
    return value


def as_str(value: Any, param: str, max_len: int | None = None, non_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise type_error(param, "a string", value)
    if non_empty and not value:
        raise bad_request(f"'{param}' must not be empty.", param=param)
    if max_len is not None and len(value) > max_len:
        raise bad_request(
            f"'{param}' is too long: {len(value)} characters, the maximum is {max_len}.",
            param=param,
        )
    return value


def as_list(value: Any, param: str, non_empty: bool = False) -> list[Any]:
    if not isinstance(value, list):
        raise type_error(param, "an array", value)
    if non_empty and not value:
        raise bad_request(f"'{param}' must be a non-empty array.", param=param)
    return value


def as_object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise type_error(param, "an object", value)
    return value


def optional(obj: dict[str, Any], name: str, default: T) -> Any | T:
    """The field's value, or ``default`` when absent or null."""
    value = obj.get(name)
    return default if value is None else value


def require(obj: dict[str, Any], name: str, param: str | None = None) -> Any:
    value = obj.get(name)
    if value is None:
        param = param or name
        raise bad_request(f"Missing required parameter: '{param}'.", param=param)
    return value
