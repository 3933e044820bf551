from __future__ import annotations

import pytest

from pdserve.api import fields
from pdserve.api.errors import ApiError


def _check_chat(body: dict) -> None:
    fields.check_fields(body, fields.CHAT_SUPPORTED, fields.CHAT_IGNORED, fields.CHAT_CONDITIONAL)


def _check_completion(body: dict) -> None:
    fields.check_fields(
        body,
        fields.COMPLETION_SUPPORTED,
        fields.COMPLETION_IGNORED,
        fields.COMPLETION_CONDITIONAL,
    )


def test_unknown_field_gets_openais_wording_and_param() -> None:
    with pytest.raises(ApiError) as info:
        _check_chat({"model": "m", "temprature": 0.5})
    assert info.value.status == 400
    assert info.value.message == "Unrecognized request argument supplied: temprature"
    assert info.value.param == "temprature"


def test_harmless_openai_fields_are_accepted() -> None:
    _check_chat(
        {
            "user": "u",
            "store": False,
            "metadata": {"k": "v"},
            "service_tier": "auto",
            "parallel_tool_calls": True,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "logit_bias": {},
        }
    )
    _check_completion({"user": "u", "echo": False, "best_of": 1, "suffix": None})


@pytest.mark.parametrize(
    "name, value",
    [
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("audio", {"voice": "x"}),
    ],
)
def test_chat_fields_we_cannot_honour_are_refused_by_name(name: str, value: object) -> None:
    with pytest.raises(ApiError) as info:
        _check_chat({name: value})
    assert info.value.status == 400 and info.value.param == name
    assert "not supported" in info.value.message


@pytest.mark.parametrize(
    "name, value",
    [
        ("best_of", 2),
        ("best_of", True),
        ("suffix", "tail"),
    ],
)
def test_completion_fields_we_cannot_honour_are_refused(name: str, value: object) -> None:
    with pytest.raises(ApiError) as info:
        _check_completion({name: value})
    assert info.value.param == name


def test_chat_only_fields_are_unknown_to_completions() -> None:
    with pytest.raises(ApiError, match="Unrecognized request argument supplied: messages"):
        _check_completion({"messages": []})
    with pytest.raises(ApiError, match="Unrecognized request argument supplied: prompt"):
        _check_chat({"prompt": "x"})
