"""Wire basics of the KV transport: limits, the validation error, typed field readers, orjson.

Every ``*Msg`` in :mod:`pdserve.transport.messages` parses its fields with these readers, which
check types and bounds and raise :class:`MessageError` (HTTP 400) on anything unexpected.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, TypeVar

import orjson

MAX_ID_LEN = 256  # engine ids, incarnations, room ids, agent names
MAX_REASON_LEN = 512
MAX_METADATA_BYTES = 4 << 20  # NIXL agent metadata is a few KiB; bound it anyway
MAX_PAGE_ID = (1 << 31) - 1
MAX_TOKENS = (1 << 31) - 1
MAX_NONCE = (1 << 63) - 1
MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_PAGES = 1 << 16

M = TypeVar("M")


class MessageError(ValueError):
    """A message that fails validation: answered with HTTP 400 / dropped, never applied."""


# -- field readers -------------------------------------------------------------------------------


def read_field(d: dict[str, Any], key: str) -> Any:
    if key not in d:
        raise MessageError(f"missing field {key!r}")
    return d[key]


def read_str(d: dict[str, Any], key: str, max_len: int = MAX_ID_LEN) -> str:
    value = read_field(d, key)
    if not isinstance(value, str) or not value:
        raise MessageError(f"{key!r} must be a non-empty string")
    if len(value) > max_len:
        raise MessageError(f"{key!r} longer than {max_len} characters")
    return value


def read_int(d: dict[str, Any], key: str, lo: int, hi: int) -> int:
    value = read_field(d, key)
    if type(value) is not int:  # bool is an int subclass: reject it explicitly
        raise MessageError(f"{key!r} must be an integer")
    if not lo <= value <= hi:
        raise MessageError(f"{key!r}={value} out of range [{lo}, {hi}]")
    return value


def read_opt_int(d: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    return None if d.get(key) is None else read_int(d, key, lo, hi)


def read_logprob(value: Any, key: str) -> float:
    if type(value) not in (int, float) or not -1e30 <= value <= 0.0:  # also rejects NaN
        raise MessageError(f"{key!r} must be a log-probability (a float <= 0)")
    return float(value)


def read_opt_logprob(d: dict[str, Any], key: str) -> float | None:
    return None if d.get(key) is None else read_logprob(d[key], key)


def read_top_logprobs(d: dict[str, Any], key: str) -> tuple[tuple[int, float], ...]:
    value = d.get(key) or []
    if not isinstance(value, list) or len(value) > MAX_TOP_LOGPROBS:
        raise MessageError(f"{key!r} must be a list of at most {MAX_TOP_LOGPROBS} pairs")
    pairs = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int):
            raise MessageError(f"{key!r} must hold [token_id, logprob] pairs")
        if not 0 <= item[0] <= MAX_TOKENS:
            raise MessageError(f"{key!r} holds an out-of-range token id")
        pairs.append((item[0], read_logprob(item[1], key)))
    return tuple(pairs)


def read_bool(d: dict[str, Any], key: str) -> bool:
    value = read_field(d, key)
    if type(value) is not bool:
        raise MessageError(f"{key!r} must be a boolean")
    return value


def read_b64(d: dict[str, Any], key: str, max_bytes: int) -> bytes:
    value = read_str(d, key, max_len=(max_bytes * 4) // 3 + 4)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MessageError(f"{key!r} is not valid base64: {e}") from None


def read_page_ids(d: dict[str, Any], key: str, max_pages: int) -> list[int]:
    value = read_field(d, key)
    if not isinstance(value, list) or not value:
        raise MessageError(f"{key!r} must be a non-empty list of page ids")
    if len(value) > max_pages:
        raise MessageError(f"{key!r} has {len(value)} pages, more than {max_pages}")
    if not all(type(p) is int for p in value):
        raise MessageError(f"{key!r} must hold integers only")
    if min(value) < 0 or max(value) > MAX_PAGE_ID:
        raise MessageError(f"{key!r} holds a negative or too large page id")
    if len(set(value)) != len(value):  # two slots aliasing one page would corrupt the KV
        raise MessageError(f"{key!r} holds a page id twice")
    return value


def as_dict(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise MessageError("message must be a JSON object")
    return raw


def decode(cls: type[M], body: bytes) -> M:
    """Parse and validate ``body`` (orjson) into ``cls``; raises MessageError."""
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise MessageError(f"invalid JSON: {e}") from None
    return cls.from_dict(as_dict(raw))  # type: ignore[attr-defined]


def encode(msg: Any) -> bytes:
    """orjson bytes of a ``*Msg`` (its ``to_dict()``)."""
    return orjson.dumps(msg.to_dict())


def error_body(code: str, message: str) -> bytes:
    """The JSON body of every bootstrap error response."""
    return orjson.dumps({"error": {"code": code, "message": message}})
