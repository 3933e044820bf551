from __future__ import annotations

import threading

import pytest

from pdserve.api.config import ApiConfig
from pdserve.api.errors import ApiError
from pdserve.api.prepare import choice_id, prepare_chat, prepare_completion, resolve_max_tokens
from pdserve.api.protocol import parse_chat_request, parse_completion_request

from .engine_double import ByteTokenizer

TOKENIZER = ByteTokenizer()
CONFIG = ApiConfig(served_model_name="m", default_max_tokens=16, request_deadline_s=30.0)


async def _completion(body: dict, max_model_len: int = 64, config: ApiConfig = CONFIG):
    parsed = parse_completion_request({"model": "m", **body}, config, TOKENIZER.vocab_size)
    return await prepare_completion(parsed, "rid", TOKENIZER, max_model_len, config)


def test_omitted_max_tokens_is_clamped_to_the_window() -> None:
    assert resolve_max_tokens(10, None, 64, 16, "prompt") == 16
    assert resolve_max_tokens(60, None, 64, 16, "prompt") == 4
    assert resolve_max_tokens(60, 4, 64, 16, "prompt") == 4


def test_window_errors_state_the_numbers() -> None:
    with pytest.raises(ApiError) as info:
        resolve_max_tokens(60, 10, 64, 16, "messages")
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    assert (
        "64 tokens" in info.value.message
        and "70 tokens (60 in the messages, 10" in info.value.message
    )
    with pytest.raises(ApiError, match="resulted in 64 tokens"):
        resolve_max_tokens(64, None, 64, 16, "prompt")
    with pytest.raises(ApiError, match="resulted in 99 tokens"):
        resolve_max_tokens(99, None, 64, 16, "prompt")


async def test_single_choice_keeps_the_request_and_room_ids() -> None:
    kv = {"room_id": "room9", "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998}
    prepared = await _completion({"prompt": "abc", "kv_transfer_params": kv, "seed": 5})
    (req,) = prepared.engine_requests
    assert req.request_id == "rid" and req.kv_transfer.room_id == "room9"
    assert req.prompt_token_ids == [97, 98, 99] and req.sampling.seed == 5
    assert req.deadline_s == 30.0 and req.sampling.max_tokens == 16


async def test_choices_get_suffixed_ids_rooms_and_seeds_prompt_major() -> None:
    kv = {"room_id": "room9", "bootstrap_host": "h", "bootstrap_port": 1}
    prepared = await _completion(
        {"prompt": ["ab", "xyz"], "n": 2, "seed": 10, "kv_transfer_params": kv, "max_tokens": 3}
    )
    reqs = prepared.engine_requests
    assert [r.request_id for r in reqs] == ["rid-0", "rid-1", "rid-2", "rid-3"]
    assert [r.kv_transfer.room_id for r in reqs] == ["room9-0", "room9-1", "room9-2", "room9-3"]
    assert [r.sampling.seed for r in reqs] == [10, 11, 12, 13]
    ab, xyz = [97, 98], [120, 121, 122]
    assert [r.prompt_token_ids for r in reqs] == [ab, ab, xyz, xyz]
    assert prepared.prompt_lens == [2, 3] and prepared.num_choices == 4
    assert choice_id("x", 0, 1) == "x" and choice_id("x", 3, 4) == "x-3"


async def test_batch_fails_whole_when_one_prompt_exceeds_the_window() -> None:
    with pytest.raises(ApiError) as info:
        await _completion({"prompt": ["ok", "y" * 70]})
    assert info.value.code == "context_length_exceeded"


async def test_chat_uses_the_template_without_extra_special_tokens() -> None:
    parsed = parse_chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, CONFIG, 257
    )
    prepared = await prepare_chat(parsed, "c1", TOKENIZER, 64, CONFIG)
    expected = TOKENIZER.encode(TOKENIZER.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert prepared.engine_requests[0].prompt_token_ids == expected


async def test_template_rejection_is_a_400_about_messages() -> None:
    body = {"model": "m", "messages": [{"role": "assistant", "content": "done"}]}
    parsed = parse_chat_request(body, CONFIG, 257)
    with pytest.raises(ApiError) as info:
        await prepare_chat(parsed, "c1", TOKENIZER, 64, CONFIG)
    assert info.value.status == 400 and info.value.param == "messages"
    assert "must not end with an assistant message" in info.value.message


class _ThreadRecordingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        self.threads: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.get_ident())
        return super().encode(text, add_special_tokens)


async def test_long_prompts_are_tokenized_off_the_event_loop() -> None:
    config = ApiConfig(served_model_name="m", max_inline_tokenize_chars=8)
    tokenizer = _ThreadRecordingTokenizer()
    for prompt in ("short", "a much longer prompt"):
        parsed = parse_completion_request({"model": "m", "prompt": prompt}, config, 257)
        prepared = await prepare_completion(parsed, "r", tokenizer, 64, config)
        assert prepared.engine_requests[0].prompt_token_ids == list(prompt.encode())
    loop_thread = threading.get_ident()
    assert tokenizer.threads[0] == loop_thread and tokenizer.threads[1] != loop_thread
