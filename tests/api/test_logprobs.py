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
        "top_logprobs": [{}, {}, {"c": -3.0}],
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
