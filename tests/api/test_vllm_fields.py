"""Every field of vLLM's completions and chat request schemas is honoured or answered with a 400
naming it: a client written for vLLM never gets something other than what it asked for.

The field lists are vLLM's ``CompletionRequest`` and ``ChatCompletionRequest`` (vLLM 0.3x,
``vllm/entrypoints/openai/{completion,chat_completion}/protocol.py``), each with a value that
is not the default. A field that pdserve cannot honour must also be accepted at its default
value, which is what a vLLM client sends when it does not use it.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from .conftest import assert_openai_error, chat_body, completion_body
from .sse_utils import parse_sse

# Shared by both endpoints: name -> a value that is not vLLM's default.
_SHARED: dict[str, Any] = {
    "frequency_penalty": 0.5,
    "logit_bias": {"98": 1.0},
    "max_tokens": 4,
    "n": 2,
    "presence_penalty": 0.5,
    "response_format": {"type": "json_object"},
    "seed": 7,
    "stop": ["zz"],
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "temperature": 0.5,
    "top_p": 0.9,
    "user": "someone",
    "use_beam_search": True,
    "top_k": 5,
    "min_p": 0.1,
    "repetition_penalty": 1.1,
    "watermarking": True,
    "length_penalty": 0.5,
    "stop_token_ids": [3],
    "include_stop_str_in_output": True,
    "ignore_eos": True,
    "min_tokens": 1,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 3,
    "truncation_side": "right",
    "prompt_logprobs": 1,
    "logprob_token_ids": [1],
    "allowed_token_ids": [97, 98],
    "bad_words": ["bad"],
    "add_special_tokens": True,
    "structured_outputs": {"regex": "a+"},
    "priority": 1,
    "request_id": "client-chosen-id",
    "session_id": "session-1",
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "routed_experts_prompt_start": 1,
    "return_token_offsets": True,
    "return_mm_kwargs": False,
    "cache_salt": "tenant-a",
    "kv_transfer_params": {"room_id": "r-1", "bootstrap_host": "h", "bootstrap_port": 1},
    "ec_transfer_params": {"x": 1},
    "vllm_xargs": {"x": 1},
    "repetition_detection": {"max_pattern_size": 4},
    "thinking_token_budget": 16,
    "stream_interval": 4,
}
COMPLETION_FIELDS: dict[str, Any] = {
    **_SHARED,
    "echo": True,
    "logprobs": 2,
    "suffix": "after",
    "prompt_embeds": "AAAA",
}
CHAT_FIELDS: dict[str, Any] = {
    **_SHARED,
    "logprobs": True,
    "top_logprobs": 2,
    "max_completion_tokens": 4,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "auto",
    "reasoning_effort": "low",
    "include_reasoning": False,
    "parallel_tool_calls": False,
    "echo": True,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"flag": 1},
    "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"x": 1},
    "return_prompt_text": True,
}
# What some fields need beside them to mean anything (a field is judged alone otherwise).
_NEEDS: dict[str, dict[str, Any]] = {
    "stream_options": {"stream": True},
    "return_tokens_as_token_ids": {"logprobs": 1},
    "top_logprobs": {"logprobs": True},
    "continue_final_message": {"add_generation_prompt": False},
    "tool_choice": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
}
# vLLM's defaults for the fields pdserve accepts only at their default.
DEFAULTS: dict[str, Any] = {
    "use_beam_search": False,
    "watermarking": False,
    "length_penalty": 1.0,
    "allowed_token_ids": None,
    "logprob_token_ids": None,
    "bad_words": [],
    "prompt_embeds": None,
    "routed_experts_prompt_start": 0,
    "ec_transfer_params": None,
    "vllm_xargs": None,
    "repetition_detection": None,
    "thinking_token_budget": None,
    "stream_interval": None,
    "suffix": None,
    "echo": False,
    "chat_template": None,
    "media_io_kwargs": None,
    "mm_processor_kwargs": None,
    "return_prompt_text": None,
    "reasoning_effort": None,
}


# The engine double's byte tokenizer has no tokenizer.json, so grammars cannot compile here:
# tests/e2e/test_clients.py walks these on a real worker.
_NEEDS_GRAMMAR = {"response_format", "structured_outputs"}


async def _post(client: Any, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    resp = await client.post(path, json=body)
    return resp.status, await resp.read()


def _judge(name: str, status: int, raw: bytes) -> str:
    if status == 200:
        return "honoured"
    assert status == 400, (name, status, raw)
    param = assert_openai_error(orjson.loads(raw))["param"]
    assert param is not None and param.split(".")[0].split("[")[0] == name, (name, raw)
    return "refused"


def _body(is_chat: bool, name: str, value: Any) -> dict[str, Any]:
    extra = {**_NEEDS.get(name, {}), name: value}
    if is_chat and name == "return_tokens_as_token_ids":
        extra["logprobs"] = True
    if is_chat:
        content = [{"role": "user", "content": "hi"}]
        if name == "continue_final_message":
            content.append({"role": "assistant", "content": "ok"})
        return {**chat_body(), "messages": content, **extra}
    return completion_body("hello", **extra)


@pytest.mark.parametrize("is_chat", [False, True], ids=["completions", "chat"])
async def test_every_vllm_field_is_honoured_or_refused_by_name(client: Any, is_chat: bool) -> None:
    fields, path = (
        (CHAT_FIELDS, "/v1/chat/completions") if is_chat else (COMPLETION_FIELDS, "/v1/completions")
    )
    verdicts = {}
    for name, value in fields.items():
        if name in _NEEDS_GRAMMAR:
            continue
        status, raw = await _post(client, path, _body(is_chat, name, value))
        verdicts[name] = _judge(name, status, raw)
        if verdicts[name] == "refused":
            assert name in DEFAULTS, f"{name} is refused but has no accepted default"
            status, raw = await _post(client, path, _body(is_chat, name, DEFAULTS[name]))
            assert status == 200, (name, raw)
    refused = {n for n, v in verdicts.items() if v == "refused"}
    assert refused <= set(DEFAULTS)
    # The meaningful ones are honoured, never refused.
    honoured = {
        "stream_options", "skip_special_tokens", "spaces_between_special_tokens",
        "include_stop_str_in_output", "truncate_prompt_tokens", "prompt_logprobs",
        "return_token_ids", "return_tokens_as_token_ids", "cache_salt", "priority",
    }  # fmt: skip
    assert honoured <= {n for n, v in verdicts.items() if v == "honoured"}


async def test_continuous_usage_stats_puts_usage_on_every_chunk(client: Any) -> None:
    # guidellm's streaming body: it always asks for continuous_usage_stats.
    options = {"include_usage": True, "continuous_usage_stats": True}
    status, raw = await _post(
        client,
        "/v1/completions",
        completion_body("abcd", max_tokens=4, stream=True, stream_options=options),
    )
    chunks, is_done = parse_sse(raw)
    assert status == 200 and is_done
    assert all(c["usage"] is not None for c in chunks)
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion == sorted(completion) and completion[-1] == 4
    assert chunks[-1]["choices"] == []  # the usage-only chunk still closes the stream


async def test_scoring_with_max_tokens_zero_returns_the_prompt_only(client: Any) -> None:
    body = completion_body([104, 105], max_tokens=0, echo=True)
    status, raw = await _post(client, "/v1/completions", body)
    assert status == 200, raw
    out = orjson.loads(raw)
    choice = out["choices"][0]
    assert choice["text"] == "hi" and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    status, raw = await _post(client, "/v1/completions", completion_body("hi", max_tokens=0))
    assert status == 400 and orjson.loads(raw)["error"]["param"] == "max_tokens"


async def test_return_token_ids_names_prompt_and_output_ids(client: Any) -> None:
    status, raw = await _post(
        client, "/v1/completions", completion_body("ab", max_tokens=2, return_token_ids=True)
    )
    choice = orjson.loads(raw)["choices"][0]
    assert status == 200 and choice["prompt_token_ids"] == [97, 98]
    assert choice["token_ids"] == [97, 98]  # the double replays its prompt
    status, raw = await _post(
        client, "/v1/chat/completions", chat_body("ab", max_tokens=2, return_token_ids=True)
    )
    out = orjson.loads(raw)
    assert status == 200 and len(out["choices"][0]["token_ids"]) == 2
    assert out["prompt_token_ids"] and all(isinstance(i, int) for i in out["prompt_token_ids"])


async def test_truncate_prompt_tokens_keeps_the_last_tokens(client: Any, engine: Any) -> None:
    body = completion_body("abcdef", max_tokens=1, truncate_prompt_tokens=2)
    status, raw = await _post(client, "/v1/completions", body)
    assert status == 200, raw
    assert engine.requests[-1].prompt_token_ids == [101, 102]
    assert orjson.loads(raw)["usage"]["prompt_tokens"] == 2


async def test_priority_reaches_the_engine_and_a_non_integer_is_refused_by_name(
    client: Any, engine: Any
) -> None:
    status, raw = await _post(client, "/v1/completions", completion_body("ab", priority=-5))
    assert status == 200, raw
    assert engine.requests[-1].priority == -5
    for bad in ("high", 1.5, True, [1]):
        status, raw = await _post(client, "/v1/chat/completions", chat_body(priority=bad))
        assert status == 400, (bad, raw)
        assert_openai_error(orjson.loads(raw), "priority")
