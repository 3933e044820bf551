"""router/prompt_size.py: bounds on a prompt's tokens without a tokenizer, and the /tokenize
request that counts it exactly."""

from __future__ import annotations

import orjson

from pdserve.router.cache_aware import routing_text
from pdserve.router.prompt_size import (
    SPECIAL_SLACK_TOKENS,
    TEMPLATE_SLACK_TOKENS,
    conversation,
    count_from_reply,
    num_prompts,
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


def test_a_responses_input_counts_as_the_chat_it_stands_for() -> None:
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    as_string = {"input": "héllo", "instructions": "be brief"}
    parts = [{"type": "input_text", "text": "hé"}, {"type": "input_text", "text": "llo"}]
    as_items = {"instructions": "be brief", "input": [{"role": "user", "content": parts}]}
    high = len(orjson.dumps(chat)) + len(orjson.dumps(None)) + TEMPLATE_SLACK_TOKENS
    for body in (as_string, as_items):
        assert conversation(body) == chat
        assert prompt_bounds(body).high == high
        assert tokenize_request(body) == {"messages": chat}
    developer = {"input": [{"role": "developer", "content": "x"}]}
    assert conversation(developer) == [{"role": "system", "content": "x"}]
    assert prompt_bounds({"input": 5}).high == 0  # the worker's 400, not a count


def test_a_batch_of_token_id_prompts_is_counted_exactly_and_summed() -> None:
    ids = prompt_bounds({"prompt": [[1, 2, 3], [4, 5]]})
    assert (ids.low, ids.high, ids.is_exact) == (5, 5, True)
    mixed = prompt_bounds({"prompt": [[1, 2], "ab"]})
    assert (mixed.low, mixed.high) == (2, 2 + 2 + SPECIAL_SLACK_TOKENS)
    for odd in ({"prompt": [[1, "a"]]}, {"prompt": [[]]}, {"prompt": [[1], 5]}):
        assert prompt_bounds(odd).high == 0
    assert num_prompts({"prompt": [[1, 2], [3]]}) == 2
    assert num_prompts({"prompt": [1, 2]}) == num_prompts({"prompt": "a"}) == 1


def test_hostile_shapes_are_counted_without_raising_the_worker_refuses_them() -> None:
    odd_bodies = (
        {"input": [{"role": ["user"], "content": [{"type": "input_text", "text": 5}]}]},
        {"input": [{"role": {}, "content": None}, "text"], "instructions": 7},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]},
        {"input": None}, {"prompt": [[1, 2], [True]]}, {"prompt": [None]},
    )  # fmt: skip
    for body in odd_bodies:
        prompt_bounds(body)
        tokenize_request(body)
        routing_text(body)
    assert routing_text(odd_bodies[2]) == "<user>"
