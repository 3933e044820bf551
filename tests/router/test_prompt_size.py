"""router/prompt_size.py: bounds on a prompt's tokens without a tokenizer, and the /tokenize
request that counts it exactly."""

from __future__ import annotations

import orjson

from pdserve.router.prompt_size import (
    SPECIAL_SLACK_TOKENS,
    TEMPLATE_SLACK_TOKENS,
    count_from_reply,
    prompt_bounds,
    tokenize_request,
)


def test_token_ids_are_counted_exactly_and_text_is_bounded_by_its_bytes() -> None:
    ids = prompt_bounds({"prompt": [5, 6, 7]})
    assert (ids.low, ids.high, ids.is_exact) == (3, 3, True)
    text = prompt_bounds({"prompt": "héllo"})  # 6 UTF-8 bytes
    assert (text.low, text.high) == (0, 6 + SPECIAL_SLACK_TOKENS) and not text.is_exact
    batch = prompt_bounds({"prompt": ["ab", "cde"]})
    assert batch.high == 5 + 2 * SPECIAL_SLACK_TOKENS


def test_a_chat_is_bounded_by_its_messages_and_tools_plus_the_template() -> None:
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    bounds = prompt_bounds({"messages": messages, "tools": tools})
    size = len(orjson.dumps(messages)) + len(orjson.dumps(tools))
    assert (bounds.low, bounds.high) == (0, size + TEMPLATE_SLACK_TOKENS)


def test_a_malformed_prompt_counts_nothing_the_worker_refuses_it() -> None:
    for body in ({}, {"prompt": 5}, {"prompt": []}, {"prompt": [1, "a"]}):
        assert prompt_bounds(body).high == 0


def test_the_tokenize_request_renders_what_the_worker_will() -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": [], "max_tokens": 3,
            "add_generation_prompt": False, "temperature": 0}  # fmt: skip
    assert tokenize_request(chat) == {"messages": chat["messages"], "tools": [],
                                      "add_generation_prompt": False}  # fmt: skip
    assert tokenize_request({"prompt": "hi", "max_tokens": 3}) == {"prompt": "hi"}
    assert tokenize_request({"prompt": ["a", "b"]}) is None
    assert tokenize_request({"prompt": [1, 2]}) is None


def test_a_count_comes_from_a_vllm_shaped_answer_or_not_at_all() -> None:
    assert count_from_reply(b'{"count": 7, "tokens": [1]}') == 7
    for raw in (b"[]", b"{}", b'{"count": -1}', b'{"count": "7"}', b"not json"):
        assert count_from_reply(raw) is None
