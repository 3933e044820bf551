from __future__ import annotations

import pytest

from pdserve.api.config import ApiConfig
from pdserve.api.errors import ApiError
from pdserve.api.protocol import (
    parse_chat_request,
    parse_completion_request,
    parse_prompt,
    resolve_request_id,
)

CONFIG = ApiConfig(served_model_name="m", max_n=4)
VOCAB = 257


def _chat(messages: object, **extra: object):
    return parse_chat_request({"model": "m", "messages": messages, **extra}, CONFIG, VOCAB)


def test_model_is_required_and_must_be_the_served_one() -> None:
    with pytest.raises(ApiError) as info:
        parse_chat_request({"messages": [{"role": "user", "content": "x"}]}, CONFIG, VOCAB)
    assert info.value.status == 400 and info.value.param == "model"
    with pytest.raises(ApiError) as info:
        parse_chat_request(
            {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, CONFIG, VOCAB
        )
    assert info.value.status == 404 and info.value.code == "model_not_found"


def test_messages_roles_and_content_shapes() -> None:
    req = _chat(
        [
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ]
    )
    assert [m.role for m in req.messages] == ["developer", "user", "assistant", "tool"]
    assert req.messages[1].content == "a\nb"
    assert req.messages[2].content == ""
    assert req.messages[0].to_template() == {"role": "system", "content": "be brief"}
    assert req.messages[3].to_template()["tool_call_id"] == "call_1"


@pytest.mark.parametrize(
    "messages, param",
    [
        (None, "messages"),
        ([], "messages"),
        ("hi", "messages"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": []}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content[0].type",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
        ([{"role": "user", "content": "x", "mood": "ok"}], "messages[0].mood"),
        (
            [{"role": "user", "content": "", "tool_calls": [{"id": "c"}]}],
            "messages[0].tool_calls",
        ),
        (["hi"], "messages[0]"),
    ],
)
def test_bad_messages_are_400_naming_the_field(messages: object, param: str) -> None:
    with pytest.raises(ApiError) as info:
        _chat(messages)
    assert info.value.status == 400 and info.value.param == param


def test_prompt_shapes_normalize_to_a_batch() -> None:
    assert parse_prompt("hi", VOCAB) == ["hi"]
    assert parse_prompt(["a", "b"], VOCAB) == ["a", "b"]
    assert parse_prompt([1, 2, 3], VOCAB) == [[1, 2, 3]]
    assert parse_prompt([[1], [2, 3]], VOCAB) == [[1], [2, 3]]


@pytest.mark.parametrize(
    "prompt",
    [
        "",
        [],
        [""],
        [[]],
        [1, "a"],
        [1, True],
        [1.0],
        [VOCAB],
        [-1],
        [[1], "a"],
        [[1, 2.5]],
        {"a": 1},
    ],
)
def test_bad_prompts_are_400(prompt: object) -> None:
    with pytest.raises(ApiError) as info:
        parse_prompt(prompt, VOCAB)
    assert info.value.status == 400 and info.value.param.startswith("prompt")


def test_out_of_vocabulary_ids_report_the_range() -> None:
    with pytest.raises(ApiError, match=r"\[0, 257\): min 3, max 999"):
        parse_prompt([3, 999], VOCAB)


def test_batch_times_n_is_bounded_by_max_n() -> None:
    body = {"model": "m", "prompt": ["a", "b", "c"], "n": 2}
    with pytest.raises(ApiError, match=r"3 prompts x n=2 = 6, the maximum is 4"):
        parse_completion_request(body, CONFIG, VOCAB)
    req = parse_completion_request({"model": "m", "prompt": ["a", "b"], "n": 2}, CONFIG, VOCAB)
    assert req.prompts == ["a", "b"] and req.options.n == 2


def test_request_id_from_header_or_generated() -> None:
    assert resolve_request_id("router-7", "chatcmpl") == "router-7"
    generated = resolve_request_id(None, "cmpl")
    assert generated.startswith("cmpl-") and len(generated) == len("cmpl-") + 32
    assert resolve_request_id(None, "cmpl") != generated
    for bad in ("", "x" * 129, "a b", "ü"):
        with pytest.raises(ApiError) as info:
            resolve_request_id(bad, "cmpl")
        assert info.value.param == "X-Request-Id"
