"""Prompt-lookup drafts: the tokens that followed the last n-gram where it occurred before.

vLLM's ``prompt_lookup_min/max``: the longest suffix of the request's tokens (prompt and output)
of ``max`` down to ``min`` tokens that also occurs earlier proposes the tokens after its first
earlier occurrence. One numpy pass per n over the history's sliding windows: no Python loop
over the tokens.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` draft tokens for the sequence ``token_ids`` (none when no n-gram matches)."""
    num = len(token_ids)
    if k <= 0 or num <= n_min:
        return []
    history = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, num - 1), n_min - 1, -1):
        suffix = history[num - n :]
        # Windows starting before the suffix itself, and leaving one token after them.
        windows = sliding_window_view(history[: num - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return history[start : start + k].tolist()
    return []
