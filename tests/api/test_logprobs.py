from __future__ import annotations

import math

from pdserve.api.logprobs import (
    MIN_LOGPROB,
    TokenTexts,
    chat_logprobs,
    clamp_logprob,
    completion_logprobs,
    merge_completion_logprobs,
)
from pdserve.engine.protocol import TokenLogprob

from .engine_double import ByteTokenizer


class _CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        self.num_decodes = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.num_decodes += 1
        return super().decode(ids, skip_special_tokens)


def test_non_finite_logprobs_become_openais_floor() -> None:
    assert clamp_logprob(-math.inf) == MIN_LOGPROB
    assert clamp_logprob(math.nan) == MIN_LOGPROB
    assert clamp_logprob(-1e6) == MIN_LOGPROB
    assert clamp_logprob(-0.5) == -0.5


def test_chat_entries_have_token_bytes_and_tops() -> None:
    texts = TokenTexts(ByteTokenizer())
    entries = [TokenLogprob(104, -0.1, ((104, -0.1), (105, -2.0))), TokenLogprob(256, -1.0)]
    items = chat_logprobs(entries, texts)
    assert items[0] == {
        "token": "h",
        "logprob": -0.1,
        "bytes": [104],
        "top_logprobs": [
            {"token": "h", "logprob": -0.1, "bytes": [104]},
            {"token": "i", "logprob": -2.0, "bytes": [105]},
        ],
    }
    assert items[1]["token"] == "</s>" and items[1]["top_logprobs"] == []


def test_completion_text_offsets_continue_across_deltas() -> None:
    texts = TokenTexts(ByteTokenizer())
    first, offset = completion_logprobs([TokenLogprob(97, -1.0), TokenLogprob(98, -2.0)], texts, 0)
    second, offset = completion_logprobs([TokenLogprob(99, -3.0, ((99, -3.0),))], texts, offset)
    assert first["text_offset"] == [0, 1] and second["text_offset"] == [2] and offset == 3
    merged = merge_completion_logprobs([first, second])
    assert merged == {
        "tokens": ["a", "b", "c"],
        "token_logprobs": [-1.0, -2.0, -3.0],
        "top_logprobs": [{"a": -1.0}, {"b": -2.0}, {"c": -3.0}],
        "text_offset": [0, 1, 2],
    }


def test_token_texts_memoize_and_stay_bounded() -> None:
    tokenizer = _CountingTokenizer()
    texts = TokenTexts(tokenizer, max_entries=4)
    for _ in range(3):
        assert texts.text(120) == "x"
    assert tokenizer.num_decodes == 1
    for token_id in range(97, 107):
        texts.text(token_id)
    assert len(texts._cache) <= 4


def test_completion_top_logprobs_always_hold_the_chosen_token() -> None:
    # Sampled ' stand' at -8.57 while the single top alternative is ' us': OpenAI's legacy API
    # and vLLM list both, so top_logprobs[i][tokens[i]] never raises KeyError.
    texts = TokenTexts(ByteTokenizer())
    block, _ = completion_logprobs([TokenLogprob(115, -8.57, ((117, -7.3),))], texts, 0)
    assert block["top_logprobs"] == [{"u": -7.3, "s": -8.57}]
    token = block["tokens"][0]
    assert block["top_logprobs"][0][token] == block["token_logprobs"][0]


def test_tokens_can_be_named_by_id() -> None:
    texts = TokenTexts(ByteTokenizer())
    block, _ = completion_logprobs([TokenLogprob(97, -1.0, ((98, -0.5),))], texts, 0, None, True)
    assert block["tokens"] == ["token_id:97"]
    assert block["top_logprobs"] == [{"token_id:98": -0.5, "token_id:97": -1.0}]
    assert block["text_offset"] == [0]  # offsets still count the text
    items = chat_logprobs([TokenLogprob(97, -1.0)], texts, as_ids=True)
    assert items[0]["token"] == "token_id:97" and items[0]["bytes"] == [97]
