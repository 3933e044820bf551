"""Log-probabilities of the prompt's own tokens (``echo`` with ``logprobs`` on completions).

The prefill already holds the hidden state of every prompt position; row ``p`` predicts token
``p + 1``. The LM head runs over those rows in chunks (a long prompt's ``(n, vocab)`` float32
logits would otherwise be hundreds of MiB), and each chunk's log-softmax is gathered at the
next tokens and, when asked, reduced to its top entries.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.kernels.attention import PrefillSeqMeta
from pdserve.sequence import Sequence
from pdserve.types import TokenLogprob

CHUNK_ROWS = 256

PromptLogprobs = list[TokenLogprob | None]


def wants_prompt_logprobs(seq: Sequence) -> bool:
    # Only on the first prefill: a re-prefill after preemption already delivered them.
    return seq.sampling.prompt_logprobs is not None and seq.num_generated == 0


def prompt_logprobs_for(
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    metas: list[PrefillSeqMeta],
    seqs: list[Sequence],
) -> list[PromptLogprobs | None]:
    """Per sequence: None unless it asked; else one entry per prompt token (None where the
    position has no prediction: the first token, and tokens whose K/V came from a cache)."""
    out: list[PromptLogprobs | None] = []
    for meta, seq in zip(metas, seqs, strict=True):
        if not wants_prompt_logprobs(seq):
            out.append(None)
            continue
        top_n = seq.sampling.prompt_logprobs or 0
        entries: PromptLogprobs = [None] * (meta.num_cached + 1)
        targets = seq.token_ids[meta.num_cached + 1 : meta.num_cached + meta.num_new]
        for start in range(0, len(targets), CHUNK_ROWS):
            chunk_targets = targets[start : start + CHUNK_ROWS]
            first = meta.q_start + start
            rows = hidden[first : first + len(chunk_targets)]
            entries.extend(_chunk_entries(lm_head(rows), chunk_targets, top_n))
        out.append(entries[: seq.num_prompt_tokens])
    return out


def _chunk_entries(logits: torch.Tensor, targets: list[int], top_n: int) -> list[TokenLogprob]:
    logprobs = logits.float().log_softmax(dim=1)
    index = torch.tensor(targets, dtype=torch.int64, device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, index).squeeze(1).tolist()
    if top_n <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(targets, chosen, strict=True)]
    top = logprobs.topk(top_n, dim=1)
    top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    return [
        TokenLogprob(t, lp, tuple(zip(ids, lps, strict=True)))
        for t, lp, ids, lps in zip(targets, chosen, top_ids, top_lps, strict=True)
    ]
