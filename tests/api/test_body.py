from __future__ import annotations

import pytest

from pdserve.api.body import decode_json_object
from pdserve.api.errors import ApiError


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b"", "empty"),
        (b"  \n", "empty"),
        (b"{", "could not parse"),
        (b'{"temperature": NaN}', "could not parse"),
        (b'{"a": 1e999}', "could not parse"),
        (b'{"a": "\xff"}', "not valid UTF-8"),
        (b"\xfe\xff", "not valid UTF-8"),
        (b"[1, 2]", "not an array"),
        (b'"text"', "not a string"),
        (b"null", "not null"),
        (b"3", "not an integer"),
        (b"[" * 2000 + b"]" * 2000, "could not parse"),
    ],
)
def test_bad_bodies_are_400_with_a_reason(raw: bytes, fragment: str) -> None:
    with pytest.raises(ApiError) as info:
        decode_json_object(raw)
    assert info.value.status == 400
    assert fragment in info.value.message


def test_object_body_decodes() -> None:
    assert decode_json_object(b'{"model": "m", "n": 2}') == {"model": "m", "n": 2}
