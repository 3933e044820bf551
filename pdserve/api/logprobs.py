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

    def label(self, token_id: int, as_id: bool) -> str:
        """How logprob entries name a token: its text, or vLLM's ``token_id:<id>`` (for
        clients that asked ``return_tokens_as_token_ids``: every token identifiable)."""
        return f"token_id:{token_id}" if as_id else self.text(token_id)


def chat_logprobs(
    entries: list[TokenLogprob], texts: TokenTexts, as_ids: bool = False
) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` items: ``{token, logprob, bytes, top_logprobs}``."""
    out = []
    for entry in entries:
        item = _chat_token(entry.token_id, entry.logprob, texts, as_ids)
        item["top_logprobs"] = [_chat_token(tid, lp, texts, as_ids) for tid, lp in entry.top]
        out.append(item)
    return out


def _chat_token(token_id: int, logprob: float, texts: TokenTexts, as_ids: bool) -> dict[str, Any]:
    label = texts.label(token_id, as_ids)
    return {
        "token": label,
        "logprob": clamp_logprob(logprob),
        "bytes": list(texts.text(token_id).encode()),
    }


def completion_logprobs(
    entries: list[TokenLogprob | None],
    texts: TokenTexts,
    text_offset: int,
    token_ids: list[int] | None = None,
    as_ids: bool = False,
) -> tuple[dict[str, Any], int]:
    """Legacy ``{tokens, token_logprobs, top_logprobs, text_offset}`` and the next offset.

    ``text_offset`` is each token's character offset in the choice's text, carried across
    streamed chunks by the caller. A None entry (the first prompt token under ``echo``, which
    nothing predicts) has null logprobs; ``token_ids`` then names the tokens. Each
    ``top_logprobs`` entry holds the chosen token too (up to N+1 entries, as OpenAI's legacy
    API and vLLM do), so ``top_logprobs[i][tokens[i]]`` always exists.
    """
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for i, entry in enumerate(entries):
        token_id = entry.token_id if entry is not None else token_ids[i]  # type: ignore[index]
        text = texts.text(token_id)
        tokens.append(texts.label(token_id, as_ids))
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
        else:
            logprob = clamp_logprob(entry.logprob)
            token_logprobs.append(logprob)
            top = {texts.label(tid, as_ids): clamp_logprob(lp) for tid, lp in entry.top}
            top.setdefault(tokens[-1], logprob)
            tops.append(top)
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


def vllm_prompt_logprobs(
    entries: list[TokenLogprob | None], texts: TokenTexts, as_ids: bool = False
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else
    ``{token id: {logprob, rank, decoded_token}}`` for the token and its top alternatives
    (rank: 1-based among the alternatives, null when the token is not among them)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {tid: (rank, lp) for rank, (tid, lp) in enumerate(entry.top, start=1)}
        item = {
            str(tid): _vllm_entry(tid, lp, rank, texts, as_ids)
            for tid, (rank, lp) in ranked.items()
        }
        if entry.token_id not in ranked:
            item[str(entry.token_id)] = _vllm_entry(
                entry.token_id, entry.logprob, None, texts, as_ids
            )
        out.append(item)
    return out


def _vllm_entry(
    token_id: int, logprob: float, rank: int | None, texts: TokenTexts, as_ids: bool
) -> dict[str, Any]:
    return {
        "logprob": clamp_logprob(logprob),
        "rank": rank,
        "decoded_token": texts.label(token_id, as_ids),
    }
