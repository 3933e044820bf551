"""Wire messages of the KV transport: bootstrap HTTP bodies and NIXL notification payloads.

Everything crosses the wire as orjson; binary fields are base64; nothing is ever pickled. Each
``*Msg`` parses from a dict with :meth:`from_dict`, which checks types and bounds and raises
:class:`MessageError` (HTTP 400) on anything unexpected. Checks that need the peer's state (page
ids within *its* pool, incarnation) are done by the sender/receiver that owns that state.

Directions: decode -> prefill over HTTP (register, room, abort, heartbeat); prefill -> decode as
NIXL notifications (``DataNotifMsg`` attached to the WRITE itself, ``AbortNotifMsg`` standalone).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import orjson
import torch

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


def _field(d: dict[str, Any], key: str) -> Any:
    if key not in d:
        raise MessageError(f"missing field {key!r}")
    return d[key]


def _str(d: dict[str, Any], key: str, max_len: int = MAX_ID_LEN) -> str:
    value = _field(d, key)
    if not isinstance(value, str) or not value:
        raise MessageError(f"{key!r} must be a non-empty string")
    if len(value) > max_len:
        raise MessageError(f"{key!r} longer than {max_len} characters")
    return value


def _int(d: dict[str, Any], key: str, lo: int, hi: int) -> int:
    value = _field(d, key)
    if type(value) is not int:  # bool is an int subclass: reject it explicitly
        raise MessageError(f"{key!r} must be an integer")
    if not lo <= value <= hi:
        raise MessageError(f"{key!r}={value} out of range [{lo}, {hi}]")
    return value


def _opt_int(d: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    return None if d.get(key) is None else _int(d, key, lo, hi)


def _logprob(value: Any, key: str) -> float:
    if type(value) not in (int, float) or not -1e30 <= value <= 0.0:  # also rejects NaN
        raise MessageError(f"{key!r} must be a log-probability (a float <= 0)")
    return float(value)


def _opt_logprob(d: dict[str, Any], key: str) -> float | None:
    return None if d.get(key) is None else _logprob(d[key], key)


def _top_logprobs(d: dict[str, Any], key: str) -> tuple[tuple[int, float], ...]:
    value = d.get(key) or []
    if not isinstance(value, list) or len(value) > MAX_TOP_LOGPROBS:
        raise MessageError(f"{key!r} must be a list of at most {MAX_TOP_LOGPROBS} pairs")
    pairs = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int):
            raise MessageError(f"{key!r} must hold [token_id, logprob] pairs")
        if not 0 <= item[0] <= MAX_TOKENS:
            raise MessageError(f"{key!r} holds an out-of-range token id")
        pairs.append((item[0], _logprob(item[1], key)))
    return tuple(pairs)


def _bool(d: dict[str, Any], key: str) -> bool:
    value = _field(d, key)
    if type(value) is not bool:
        raise MessageError(f"{key!r} must be a boolean")
    return value


def _b64(d: dict[str, Any], key: str, max_bytes: int) -> bytes:
    value = _str(d, key, max_len=(max_bytes * 4) // 3 + 4)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MessageError(f"{key!r} is not valid base64: {e}") from None


def _page_ids(d: dict[str, Any], key: str, max_pages: int) -> list[int]:
    value = _field(d, key)
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


def _as_dict(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise MessageError("message must be a JSON object")
    return raw


def decode(cls: type[M], body: bytes) -> M:
    """Parse and validate ``body`` (orjson) into ``cls``; raises MessageError."""
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise MessageError(f"invalid JSON: {e}") from None
    return cls.from_dict(_as_dict(raw))  # type: ignore[attr-defined]


def encode(msg: Any) -> bytes:
    """orjson bytes of a ``*Msg`` (its ``to_dict()``)."""
    return orjson.dumps(msg.to_dict())


# -- pool descriptor -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolDescMsg:
    """The wire form of a page pool descriptor (``PoolDescriptor`` fields, validated)."""

    base_address: int
    page_bytes: int
    num_pages: int
    device_id: int = 0
    mem_type: str = "DRAM"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolDescMsg:
        d = _as_dict(d)
        mem_type = _str(d, "mem_type", max_len=16)
        if mem_type not in ("DRAM", "VRAM"):
            raise MessageError(f"unsupported mem_type {mem_type!r}")
        return cls(
            base_address=_int(d, "base_address", 1, (1 << 64) - 1),
            page_bytes=_int(d, "page_bytes", 1, 1 << 34),
            num_pages=_int(d, "num_pages", 1, MAX_PAGE_ID),
            device_id=_int(d, "device_id", 0, 1 << 16),
            mem_type=mem_type,
        )


# -- decode -> prefill (HTTP) --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RegisterMsg:
    """POST /register: a decode engine (one incarnation) announces its NIXL agent and pool."""

    engine_id: str
    incarnation: str
    agent_name: str
    metadata: bytes  # get_agent_metadata(); base64 on the wire
    descriptor: PoolDescMsg

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "incarnation": self.incarnation,
            "agent_name": self.agent_name,
            "metadata_b64": base64.b64encode(self.metadata).decode("ascii"),
            "descriptor": self.descriptor.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RegisterMsg:
        return cls(
            engine_id=_str(d, "engine_id"),
            incarnation=_str(d, "incarnation"),
            agent_name=_str(d, "agent_name"),
            metadata=_b64(d, "metadata_b64", MAX_METADATA_BYTES),
            descriptor=PoolDescMsg.from_dict(_field(d, "descriptor")),
        )


@dataclass(frozen=True, slots=True)
class HeartbeatMsg:
    """POST /heartbeat: the decode engine (one incarnation) is alive."""

    engine_id: str
    incarnation: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeartbeatMsg:
        return cls(engine_id=_str(d, "engine_id"), incarnation=_str(d, "incarnation"))


@dataclass(frozen=True, slots=True)
class RegisterReplyMsg:
    """Answer to /register: the prefill's identity and NIXL agent name."""

    engine_id: str
    incarnation: str
    agent_name: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RegisterReplyMsg:
        return cls(
            engine_id=_str(d, "engine_id"),
            incarnation=_str(d, "incarnation"),
            agent_name=_str(d, "agent_name"),
        )


@dataclass(frozen=True, slots=True)
class RoomMsg:
    """POST /rooms/{room_id}: the destination pages of one room on the decode side.

    ``nonce`` is unique per receiver incarnation; the sender echoes it in every notification so
    a late write or abort of an earlier room with the same id can never alias this one.
    ``num_cached_pages``: leading pages of the prompt the decode already holds (its prefix
    cache); the sender writes the prompt's pages after them into ``page_ids``.
    """

    engine_id: str
    incarnation: str
    nonce: int
    page_ids: list[int]
    num_tokens: int
    num_cached_pages: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], max_pages: int = DEFAULT_MAX_PAGES) -> RoomMsg:
        return cls(
            engine_id=_str(d, "engine_id"),
            incarnation=_str(d, "incarnation"),
            nonce=_int(d, "nonce", 0, MAX_NONCE),
            page_ids=_page_ids(d, "page_ids", max_pages),
            num_tokens=_int(d, "num_tokens", 1, MAX_TOKENS),
            num_cached_pages=_opt_int(d, "num_cached_pages", 0, MAX_PAGE_ID) or 0,
        )


@dataclass(frozen=True, slots=True)
class AbortMsg:
    """POST /abort/{room_id}: the decode side aborted its room (or asks again for the ack)."""

    engine_id: str
    incarnation: str
    nonce: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AbortMsg:
        return cls(
            engine_id=_str(d, "engine_id"),
            incarnation=_str(d, "incarnation"),
            nonce=_int(d, "nonce", 0, MAX_NONCE),
            reason=_str(d, "reason", max_len=MAX_REASON_LEN),
        )


@dataclass(frozen=True, slots=True)
class AbortReplyMsg:
    """Answer to /abort: ``is_acked`` once no write for that room can still land.

    Carries the prefill's identity: an answer from a *new* incarnation tells the decode side
    that the sender it fenced against is dead (its pages go to quarantine, not to ack).
    """

    engine_id: str
    incarnation: str
    is_acked: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AbortReplyMsg:
        return cls(
            engine_id=_str(d, "engine_id"),
            incarnation=_str(d, "incarnation"),
            is_acked=_bool(d, "is_acked"),
        )


@dataclass(frozen=True, slots=True)
class HeartbeatReplyMsg:
    """Answer to /heartbeat: the prefill's incarnation and whether it still knows the caller."""

    engine_id: str
    incarnation: str
    is_known: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeartbeatReplyMsg:
        return cls(
            engine_id=_str(d, "engine_id"),
            incarnation=_str(d, "incarnation"),
            is_known=_bool(d, "is_known"),
        )


# -- prefill -> decode (NIXL notifications) ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DataNotifMsg:
    """Attached to a chunk's WRITE: the chunk's bytes have landed when the receiver sees this."""

    room_id: str
    nonce: int
    incarnation: str  # the sender's
    chunk: int
    is_last: bool
    num_pages: int  # pages written by the room so far, this chunk included
    first_token: int | None = None  # on the last chunk
    checksum: int | None = None  # on the last chunk when TransportConfig.checksum
    # The first token's logprob and top alternatives, when the request asked for logprobs
    first_logprob: float | None = None
    first_top_logprobs: tuple[tuple[int, float], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["first_top_logprobs"] = [list(p) for p in self.first_top_logprobs]
        return {"t": "data", **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataNotifMsg:
        msg = cls(
            room_id=_str(d, "room_id"),
            nonce=_int(d, "nonce", 0, MAX_NONCE),
            incarnation=_str(d, "incarnation"),
            chunk=_int(d, "chunk", 0, MAX_PAGE_ID),
            is_last=_bool(d, "is_last"),
            num_pages=_int(d, "num_pages", 1, MAX_PAGE_ID),
            first_token=_opt_int(d, "first_token", 0, MAX_TOKENS),
            checksum=_opt_int(d, "checksum", 0, MAX_NONCE),
            first_logprob=_opt_logprob(d, "first_logprob"),
            first_top_logprobs=_top_logprobs(d, "first_top_logprobs"),
        )
        if msg.is_last and msg.first_token is None:
            raise MessageError("the last chunk must carry first_token")
        return msg


@dataclass(frozen=True, slots=True)
class AbortNotifMsg:
    """The sender ended the room. ``is_fenced``: no write for it is outstanding any more."""

    room_id: str
    nonce: int
    incarnation: str  # the sender's
    reason: str
    is_fenced: bool

    def to_dict(self) -> dict[str, Any]:
        return {"t": "abort", **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AbortNotifMsg:
        return cls(
            room_id=_str(d, "room_id"),
            nonce=_int(d, "nonce", 0, MAX_NONCE),
            incarnation=_str(d, "incarnation"),
            reason=_str(d, "reason", max_len=MAX_REASON_LEN),
            is_fenced=_bool(d, "is_fenced"),
        )


_NOTIF_TYPES: dict[str, Any] = {"data": DataNotifMsg, "abort": AbortNotifMsg}


def decode_notif(payload: bytes) -> DataNotifMsg | AbortNotifMsg:
    """Parse a NIXL notification payload; raises MessageError."""
    try:
        raw = _as_dict(orjson.loads(payload))
    except orjson.JSONDecodeError as e:
        raise MessageError(f"invalid notification JSON: {e}") from None
    kind = raw.get("t")
    cls = _NOTIF_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError(f"unknown notification type {raw.get('t')!r}")
    return cls.from_dict(raw)


def error_body(code: str, message: str) -> bytes:
    """The JSON body of every bootstrap error response."""
    return orjson.dumps({"error": {"code": code, "message": message}})


# -- optional page checksum ----------------------------------------------------------------------

_CHECKSUM_MASK = (1 << 63) - 1


def page_checksum(kv: torch.Tensor, page_ids: list[int]) -> int:
    """Order-sensitive checksum of pages ``page_ids`` of a page-major KV tensor (vectorized).

    Per-page sums of the pages' 32-bit (or 16-bit) words, weighted by the page's position in the
    list, so a wrong page, a swapped pair or garbage all change it. Fits the wire's 63 bits.
    """
    idx = torch.tensor(page_ids, dtype=torch.long, device=kv.device)
    flat = kv.index_select(0, idx).reshape(len(page_ids), -1).view(torch.uint8)
    word = torch.int32 if flat.shape[1] % 4 == 0 else torch.int16
    sums = flat.view(word).sum(dim=1, dtype=torch.int64)
    weights = torch.arange(1, len(page_ids) + 1, dtype=torch.int64, device=kv.device) * 0x9E3779B1
    return int((sums * weights).sum().item()) & _CHECKSUM_MASK


async def page_checksum_off_loop(kv: torch.Tensor, page_ids: list[int]) -> int:
    """:func:`page_checksum` on an executor thread (torch releases the GIL), on one torch thread
    there: a second OpenMP thread team in the process would slow every model step (see
    pdserve/engine/runner_thread.py)."""

    def one_thread() -> int:
        torch.set_num_threads(1)  # this thread's own OpenMP setting; the runner's is unchanged
        return page_checksum(kv, page_ids)

    return await asyncio.to_thread(one_thread)
