"""Wire messages of the KV transport: bootstrap HTTP bodies and NIXL notification payloads.

Everything crosses the wire as orjson; binary fields are base64; nothing is ever pickled. Each
``*Msg`` parses from a dict with :meth:`from_dict`, which checks types and bounds and raises
:class:`MessageError` (HTTP 400) on anything unexpected. Checks that need the peer's state (page
ids within *its* pool, incarnation) are done by the sender/receiver that owns that state.

Directions: decode -> prefill over HTTP (register, room, abort, heartbeat); prefill -> decode as
NIXL notifications (``DataNotifMsg`` attached to the WRITE itself, ``AbortNotifMsg`` standalone).
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from pdserve.transport.wire import (
    DEFAULT_MAX_PAGES,
    MAX_METADATA_BYTES,
    MAX_NONCE,
    MAX_PAGE_ID,
    MAX_REASON_LEN,
    MAX_TOKENS,
    MessageError,
    as_dict,
    read_b64,
    read_bool,
    read_field,
    read_int,
    read_opt_int,
    read_opt_logprob,
    read_page_ids,
    read_str,
    read_top_logprobs,
)

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
        d = as_dict(d)
        mem_type = read_str(d, "mem_type", max_len=16)
        if mem_type not in ("DRAM", "VRAM"):
            raise MessageError(f"unsupported mem_type {mem_type!r}")
        return cls(
            base_address=read_int(d, "base_address", 1, (1 << 64) - 1),
            page_bytes=read_int(d, "page_bytes", 1, 1 << 34),
            num_pages=read_int(d, "num_pages", 1, MAX_PAGE_ID),
            device_id=read_int(d, "device_id", 0, 1 << 16),
            mem_type=mem_type,
        )


PAGE_ORDER = "head-major"  # (Hkv, L, 2, page, D) per page


@dataclass(frozen=True, slots=True)
class KVLayoutMsg:
    """What must match for one engine's KV pages to be another's: the model and the page layout.

    ``model`` is the served model name, ``fingerprint`` a hash of the checkpoint's architecture
    config (``pdserve.transport.layout.model_fingerprint``), ``weights`` one of its tensors
    (``pdserve.model.fingerprint``: one architecture, other weights), ``dtype`` the KV dtype's
    torch name (``"bfloat16"``). Equal page bytes are not enough: bf16 and fp16 pages, or 32
    layers x 8 heads and 64 layers x 4 heads, have the same size and would pair up into garbage.
    """

    model: str
    fingerprint: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    page_bytes: int
    weights: str = ""
    # the order inside a page (kernels/kv_cache.py); a peer of another order is refused
    page_order: str = PAGE_ORDER

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayoutMsg:
        d = as_dict(d)
        ints = {k: read_int(d, k, 1, 1 << 20) for k in ("num_layers", "num_kv_heads", "head_dim")}
        return cls(
            model=_read_opt_str(d, "model"),
            fingerprint=_read_opt_str(d, "fingerprint"),
            weights=_read_opt_str(d, "weights"),
            dtype=read_str(d, "dtype", max_len=32),
            page_size=read_int(d, "page_size", 1, 1 << 20),
            page_bytes=read_int(d, "page_bytes", 1, 1 << 34),
            # absent: a peer from before the order was named (token-major pages)
            page_order=read_str(d, "page_order", max_len=32) if "page_order" in d else "token",
            **ints,
        )

    def mismatches(self, other: KVLayoutMsg, us: str = "ours", them: str = "theirs") -> list[str]:
        """``"field (ours X, theirs Y)"`` for each field that differs (empty: compatible)."""
        a, b = self.to_dict(), other.to_dict()
        return [f"{k} ({us} {a[k]!r}, {them} {b[k]!r})" for k in a if a[k] != b[k]]


def _read_opt_str(d: dict[str, Any], key: str) -> str:
    """A string field that may be empty (an engine without a model name, e.g. in tests)."""
    value = read_field(d, key)
    if not isinstance(value, str) or len(value) > 256:
        raise MessageError(f"{key!r} must be a string of at most 256 characters")
    return value


# -- decode -> prefill (HTTP) --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RegisterMsg:
    """POST /register: a decode engine (one incarnation) announces its NIXL agent and pool."""

    engine_id: str
    incarnation: str
    agent_name: str
    metadata: bytes  # get_agent_metadata(); base64 on the wire
    descriptor: PoolDescMsg
    layout: KVLayoutMsg  # checked against the prefill's before anything is loaded

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "incarnation": self.incarnation,
            "agent_name": self.agent_name,
            "metadata_b64": base64.b64encode(self.metadata).decode("ascii"),
            "descriptor": self.descriptor.to_dict(),
            "layout": self.layout.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RegisterMsg:
        return cls(
            engine_id=read_str(d, "engine_id"),
            incarnation=read_str(d, "incarnation"),
            agent_name=read_str(d, "agent_name"),
            metadata=read_b64(d, "metadata_b64", MAX_METADATA_BYTES),
            descriptor=PoolDescMsg.from_dict(read_field(d, "descriptor")),
            layout=KVLayoutMsg.from_dict(read_field(d, "layout")),
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
        return cls(engine_id=read_str(d, "engine_id"), incarnation=read_str(d, "incarnation"))


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
            engine_id=read_str(d, "engine_id"),
            incarnation=read_str(d, "incarnation"),
            agent_name=read_str(d, "agent_name"),
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
            engine_id=read_str(d, "engine_id"),
            incarnation=read_str(d, "incarnation"),
            nonce=read_int(d, "nonce", 0, MAX_NONCE),
            page_ids=read_page_ids(d, "page_ids", max_pages),
            num_tokens=read_int(d, "num_tokens", 1, MAX_TOKENS),
            num_cached_pages=read_opt_int(d, "num_cached_pages", 0, MAX_PAGE_ID) or 0,
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
            engine_id=read_str(d, "engine_id"),
            incarnation=read_str(d, "incarnation"),
            nonce=read_int(d, "nonce", 0, MAX_NONCE),
            reason=read_str(d, "reason", max_len=MAX_REASON_LEN),
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
            engine_id=read_str(d, "engine_id"),
            incarnation=read_str(d, "incarnation"),
            is_acked=read_bool(d, "is_acked"),
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
            engine_id=read_str(d, "engine_id"),
            incarnation=read_str(d, "incarnation"),
            is_known=read_bool(d, "is_known"),
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
            room_id=read_str(d, "room_id"),
            nonce=read_int(d, "nonce", 0, MAX_NONCE),
            incarnation=read_str(d, "incarnation"),
            chunk=read_int(d, "chunk", 0, MAX_PAGE_ID),
            is_last=read_bool(d, "is_last"),
            num_pages=read_int(d, "num_pages", 1, MAX_PAGE_ID),
            first_token=read_opt_int(d, "first_token", 0, MAX_TOKENS),
            checksum=read_opt_int(d, "checksum", 0, MAX_NONCE),
            first_logprob=read_opt_logprob(d, "first_logprob"),
            first_top_logprobs=read_top_logprobs(d, "first_top_logprobs"),
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
            room_id=read_str(d, "room_id"),
            nonce=read_int(d, "nonce", 0, MAX_NONCE),
            incarnation=read_str(d, "incarnation"),
            reason=read_str(d, "reason", max_len=MAX_REASON_LEN),
            is_fenced=read_bool(d, "is_fenced"),
        )


_NOTIF_TYPES: dict[str, Any] = {"data": DataNotifMsg, "abort": AbortNotifMsg}


def decode_notif(payload: bytes) -> DataNotifMsg | AbortNotifMsg:
    """Parse a NIXL notification payload; raises MessageError."""
    try:
        raw = as_dict(orjson.loads(payload))
    except orjson.JSONDecodeError as e:
        raise MessageError(f"invalid notification JSON: {e}") from None
    kind = raw.get("t")
    cls = _NOTIF_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError(f"unknown notification type {raw.get('t')!r}")
    return cls.from_dict(raw)
