"""Wire messages: round trips, and validation that rejects anything malformed."""

from __future__ import annotations

import base64
from dataclasses import replace

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.transport.messages import (
    AbortMsg,
    AbortNotifMsg,
    AbortReplyMsg,
    DataNotifMsg,
    HeartbeatMsg,
    HeartbeatReplyMsg,
    KVLayoutMsg,
    PoolDescMsg,
    RegisterMsg,
    RegisterReplyMsg,
    RoomMsg,
    decode_notif,
)
from pdserve.transport.wire import MessageError, decode, encode

DESC = PoolDescMsg(base_address=0x7F0000000000, page_bytes=4096, num_pages=64)


LAYOUT = KVLayoutMsg("demo", "0123abcd", "bfloat16", 2, 2, 16, 16, 4096)


def _register() -> RegisterMsg:
    return RegisterMsg("decode-0", "inc1", "decode-0@inc1", b"\x00\x01nixl\xff", DESC, LAYOUT)


@pytest.mark.parametrize(
    "msg",
    [
        _register(),
        RegisterReplyMsg("prefill-0", "inc9", "prefill-0@inc9"),
        RoomMsg("decode-0", "inc1", 7, [3, 1, 2], 40),
        RoomMsg("decode-0", "inc1", 8, [5], 40, num_cached_pages=2),
        AbortMsg("decode-0", "inc1", 7, "client went away"),
        AbortReplyMsg("prefill-0", "inc9", True),
        HeartbeatMsg("decode-0", "inc1"),
        HeartbeatReplyMsg("prefill-0", "inc9", False),
    ],
)
def test_http_messages_round_trip_through_orjson(msg: object) -> None:
    assert decode(type(msg), encode(msg)) == msg


def test_register_carries_binary_metadata_as_base64() -> None:
    raw = orjson.loads(encode(_register()))
    assert base64.b64decode(raw["metadata_b64"]) == b"\x00\x01nixl\xff"
    assert raw["descriptor"]["num_pages"] == 64


@pytest.mark.parametrize(
    "notif",
    [
        DataNotifMsg("r1", 5, "inc9", 0, False, 4),
        DataNotifMsg("r1", 5, "inc9", 2, True, 12, first_token=42, checksum=123456789),
        AbortNotifMsg("r1", 5, "inc9", "aborted", True),
    ],
)
def test_notifications_round_trip_with_their_type_tag(notif: object) -> None:
    assert decode_notif(encode(notif)) == notif


_ROOM = {"engine_id": "d", "incarnation": "i", "nonce": 1, "page_ids": [1], "num_tokens": 4}


@pytest.mark.parametrize(
    "body, complaint",
    [
        (b"not json", "invalid JSON"),
        (b"[1, 2]", "JSON object"),
        (orjson.dumps({k: v for k, v in _ROOM.items() if k != "page_ids"}), "page_ids"),
        (orjson.dumps({**_ROOM, "page_ids": []}), "non-empty"),
        (orjson.dumps({**_ROOM, "page_ids": [1, 1]}), "twice"),
        (orjson.dumps({**_ROOM, "page_ids": [-1]}), "negative"),
        (orjson.dumps({**_ROOM, "page_ids": [1.5]}), "integers"),
        (orjson.dumps({**_ROOM, "nonce": True}), "integer"),
        (orjson.dumps({**_ROOM, "engine_id": ""}), "non-empty"),
        (orjson.dumps({**_ROOM, "num_tokens": 0}), "out of range"),
    ],
)
def test_malformed_room_messages_are_rejected_with_a_reason(body: bytes, complaint: str) -> None:
    with pytest.raises(MessageError, match=complaint):
        decode(RoomMsg, body)


def test_a_valid_room_message_parses() -> None:
    assert decode(RoomMsg, orjson.dumps(_ROOM)) == RoomMsg("d", "i", 1, [1], 4)


def test_room_message_page_list_length_is_bounded() -> None:
    raw = RoomMsg("d", "i", 1, list(range(9)), 4).to_dict()
    with pytest.raises(MessageError, match="more than 8"):
        RoomMsg.from_dict(raw, max_pages=8)


def test_overlong_ids_and_bad_base64_are_rejected() -> None:
    raw = _register().to_dict()
    with pytest.raises(MessageError, match="longer than"):
        RegisterMsg.from_dict({**raw, "engine_id": "x" * 1000})
    with pytest.raises(MessageError, match="base64"):
        RegisterMsg.from_dict({**raw, "metadata_b64": "***"})
    with pytest.raises(MessageError, match="mem_type"):
        RegisterMsg.from_dict({**raw, "descriptor": {**DESC.to_dict(), "mem_type": "DISK"}})


def test_last_data_chunk_must_carry_the_first_token() -> None:
    raw = DataNotifMsg("r", 1, "i", 0, True, 1, first_token=3).to_dict()
    raw["first_token"] = None
    with pytest.raises(MessageError, match="first_token"):
        decode_notif(orjson.dumps(raw))


def test_unknown_notification_type_is_rejected() -> None:
    with pytest.raises(MessageError, match="unknown notification"):
        decode_notif(b'{"t": "hello"}')


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 63) - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_ROOM_KEYS = ("engine_id", "incarnation", "nonce", "page_ids", "num_tokens", "t", "room_id")


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from(_ROOM_KEYS), _JSON, max_size=7) | _JSON)
def test_arbitrary_json_is_either_a_valid_message_or_a_message_error(value: object) -> None:
    body = orjson.dumps(value)
    for parse in (lambda: decode(RoomMsg, body), lambda: decode_notif(body)):
        try:
            msg = parse()
        except MessageError:
            continue
        assert decode(type(msg), encode(msg)) == msg if isinstance(msg, RoomMsg) else True


def test_layout_mismatches_name_every_differing_field_and_only_those() -> None:
    other = replace(LAYOUT, dtype="float16", num_layers=4)
    assert LAYOUT.mismatches(LAYOUT) == []
    found = LAYOUT.mismatches(other, us="prefill", them="decode")
    assert found == [
        "dtype (prefill 'bfloat16', decode 'float16')",
        "num_layers (prefill 2, decode 4)",
    ]


def test_register_without_a_valid_layout_is_refused() -> None:
    raw = _register().to_dict()
    with pytest.raises(MessageError, match="layout"):
        RegisterMsg.from_dict({k: v for k, v in raw.items() if k != "layout"})
    with pytest.raises(MessageError, match="head_dim"):
        RegisterMsg.from_dict({**raw, "layout": {**LAYOUT.to_dict(), "head_dim": 0}})
    with pytest.raises(MessageError, match="model"):
        RegisterMsg.from_dict({**raw, "layout": {**LAYOUT.to_dict(), "model": 7}})
