"""Token log-probabilities in the two OpenAI shapes (chat and legacy completions)."""

from __future__ import annotations

import math
from typing import Any

from pdserve.engine.protocol import TokenizerLike, TokenLogprob

# OpenAI reports impossible tokens as -9999.0; JSON has no -inf (orjson would write null).
MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float:
    return value if math.isfinite(value) and value > MIN_LOGPROB else MIN_LOGPROB


class TokenTexts:
    """Token id -> its text, memoized: logprob entries name every token and ids repeat a lot.

    Owned by the event loop (single writer). Bounded: cleared wholesale when full, which is
    cheaper than LRU bookkeeping and only costs a few re-decodes.
    """

    def __init__(self, tokenizer: TokenizerLike, max_entries: int = 65_536) -> None:
        self._tokenizer = tokenizer
        self._max_entries = max_entries
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if len(self._cache) >= self._max_entries:
                self._cache.clear()
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` items: ``{token, logprob, bytes, top_logprobs}``."""
    out = []
    for entry in entries:
        item = _chat_token(entry.token_id, entry.logprob, texts)
        item["top_logprobs"] = [_chat_token(tid, lp, texts) for tid, lp in entry.top]
        out.append(item)
    return out


def _chat_token(token_id: int, logprob: float, texts: TokenTexts) -> dict[str, Any]:
    text = texts.text(token_id)
    return {"token": text, "logprob": clamp_logprob(logprob), "bytes": list(text.encode())}


def completion_logprobs(
    entries: list[TokenLogprob | None],
    texts: TokenTexts,
    text_offset: int,
    token_ids: list[int] | None = None,
) -> tuple[dict[str, Any], int]:
    """Legacy ``{tokens, token_logprobs, top_logprobs, text_offset}`` and the next offset.

    ``text_offset`` is each token's character offset in the choice's text, carried across
    streamed chunks by the caller. A None entry (the first prompt token under ``echo``, which
    nothing predicts) has null logprobs; ``token_ids`` then names the tokens.
    """
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for i, entry in enumerate(entries):
        token_id = entry.token_id if entry is not None else token_ids[i]  # type: ignore[index]
        text = texts.text(token_id)
        tokens.append(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
        else:
            token_logprobs.append(clamp_logprob(entry.logprob))
            tops.append({texts.text(tid): clamp_logprob(lp) for tid, lp in entry.top})
        offsets.append(text_offset)
        text_offset += len(text)
    block = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return block, text_offset


def merge_completion_logprobs(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate per-delta legacy blocks into one (non-streaming responses)."""
    merged: dict[str, Any] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for block in blocks:
        for key, values in block.items():
            merged[key].extend(values)
    return merged
