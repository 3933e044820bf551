from __future__ import annotations

import math

import pytest

from pdserve.api.errors import ApiError
from pdserve.api.validation import as_bool, as_float, as_int, as_list, as_object, as_str, require


def test_as_int_rejects_bool_and_float_even_when_integral() -> None:
    for value in (True, False, 3.0, "3", None):
        with pytest.raises(ApiError) as info:
            as_int(value, "n")
        assert info.value.status == 400 and info.value.param == "n"
        assert info.value.code == "invalid_type"
    assert as_int(3, "n") == 3


def test_as_int_bounds_are_inclusive_and_named_in_the_message() -> None:
    assert as_int(1, "n", 1, 4) == 1 and as_int(4, "n", 1, 4) == 4
    with pytest.raises(ApiError, match=r"'n' must be <= 4, got 5"):
        as_int(5, "n", 1, 4)
    with pytest.raises(ApiError, match=r"'n' must be >= 1, got 0"):
        as_int(0, "n", 1, 4)


def test_as_float_accepts_ints_rejects_bools_and_non_finite() -> None:
    assert as_float(1, "t") == 1.0 and isinstance(as_float(1, "t"), float)
    for bad in (True, "1", [1], math.nan, math.inf, -math.inf):
        with pytest.raises(ApiError):
            as_float(bad, "t")


def test_as_float_exclusive_minimum() -> None:
    with pytest.raises(ApiError, match=r"must be > 0.0"):
        as_float(0.0, "top_p", 0.0, 1.0, min_exclusive=True)
    assert as_float(0.0, "temperature", 0.0, 2.0) == 0.0


def test_as_str_length_and_emptiness() -> None:
    assert as_str("ab", "s", max_len=2) == "ab"
    with pytest.raises(ApiError, match="too long: 3 characters"):
        as_str("abc", "s", max_len=2)
    with pytest.raises(ApiError, match="must not be empty"):
        as_str("", "s", non_empty=True)
    with pytest.raises(ApiError, match="expected a string, but got an integer"):
        as_str(1, "s")


def test_container_and_bool_checks_name_the_json_type() -> None:
    with pytest.raises(ApiError, match="expected an array, but got an object"):
        as_list({}, "stop")
    with pytest.raises(ApiError, match="non-empty array"):
        as_list([], "messages", non_empty=True)
    with pytest.raises(ApiError, match="expected an object, but got an array"):
        as_object([], "stream_options")
    with pytest.raises(ApiError, match="expected a boolean, but got an integer"):
        as_bool(1, "stream")


def test_require_treats_null_as_missing() -> None:
    with pytest.raises(ApiError, match="Missing required parameter: 'messages'"):
        require({"messages": None}, "messages")
    assert require({"messages": []}, "messages") == []
