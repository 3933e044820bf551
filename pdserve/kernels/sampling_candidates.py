"""Which few tokens a sampled row can pick: top-k, top-p and the noise bound, on ``(B, 64)``.

The sampler races ``logit / T - log(-log u)`` over a row's kept tokens. Doing that, and
top-k/top-p before it, over the whole vocabulary costs a dozen passes over ``(B, vocab)``
(noise hashing, two logs, softmax, masks). Instead, take each row's top ``CANDIDATE_WIDTH``
logits once and decide there. Every rule keeps a token iff its logit reaches a row threshold
(top-k: the k-th largest value; top-p: the nucleus floor; the race: tokens more than
``RACE_SPAN`` below the row's best can never win, since the noise term is bounded), so if the
last candidate column (the sentinel) is not kept, no token outside the candidates is either:
the row is exact. Rows that are not (a flat top-p nucleus, a large top_k, a flat distribution
at high temperature) fall back to the full-vocabulary path.

Every computation is per row over a fixed width, so a row's result does not depend on the
other rows of its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.topk import topk_rows

CANDIDATE_WIDTH = 64
# u is in [2**-25, 1 - 2**-24], so -log(-log u) is in [-2.86, 16.64]: a token whose scaled logit
# is more than 19.5 below the row's best cannot win the race. 20 leaves rounding slack.
RACE_SPAN = 20.0


@dataclass
class CandidatePlan:
    """Each row's candidate ids and race scores; ``is_exact`` rows need nothing else."""

    ids: torch.Tensor  # (B, CANDIDATE_WIDTH) int64, by descending logit
    scaled: torch.Tensor  # (B, CANDIDATE_WIDTH) float32: logit / T where kept, -inf elsewhere
    is_exact: torch.Tensor  # (B,) bool


def plan_candidates(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> CandidatePlan:
    """Candidates of every row of ``logits`` ``(B, V)``, ``V > CANDIDATE_WIDTH``.

    ``temperature`` <= 0 rows (greedy, decided elsewhere) are planned with T = 1.
    """
    vocab = logits.shape[1]
    values, ids = topk_rows(logits, CANDIDATE_WIDTH)
    temp = torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
    scaled = values / temp
    keep, is_k_exact = _top_k_keep(scaled, top_k, vocab)
    if bool((top_p < 1.0).any()):
        keep &= _top_p_keep(scaled, keep, top_p, top_k, logits, temp)
    can_win = scaled[:, -1] >= scaled[:, 0] - RACE_SPAN
    is_exact = (is_k_exact & (~keep[:, -1] | ~can_win)) | (temperature <= 0)
    return CandidatePlan(ids, scaled.masked_fill(~keep, float("-inf")), is_exact)


def _top_k_keep(
    scaled: torch.Tensor, top_k: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates at or above each row's k-th largest (all for rows without top-k), and
    whether the top-k set lies inside the candidates (the sentinel column is below the k-th
    largest); top-p then normalises over exactly that set."""
    width = scaled.shape[1]
    has_k = (top_k > 0) & (top_k < vocab)
    kth_col = (top_k.clamp(min=1, max=width) - 1).unsqueeze(1)
    keep = (scaled >= scaled.gather(1, kth_col)) | ~has_k.unsqueeze(1)
    return keep, ~has_k | ((top_k < width) & ~keep[:, -1])


def _top_p_keep(
    scaled: torch.Tensor,
    keep_k: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    logits: torch.Tensor,
    temp: torch.Tensor,
) -> torch.Tensor:
    """Candidates inside each row's top-p nucleus of the (top-k truncated) distribution.

    Rows with top-k normalise over their kept candidates (if the sentinel is kept the row is
    not exact anyway); rows without normalise over the whole vocabulary.
    """
    masked = scaled.masked_fill(~keep_k, float("-inf"))
    log_norm = masked.logsumexp(dim=1, keepdim=True)
    has_k = top_k > 0
    if not bool(has_k.all()):
        full_norm = (logits / temp).logsumexp(dim=1, keepdim=True)
        log_norm = torch.where(has_k.unsqueeze(1), log_norm, full_norm)
    probs = (masked - log_norm).exp()
    mass_before = probs.cumsum(dim=1) - probs
    # The smallest prefix whose mass reaches top_p (the first token always survives); ties
    # with its last token are kept, as in the full-vocabulary filter.
    num_keep = (mass_before < top_p.unsqueeze(1)).sum(dim=1, keepdim=True).clamp(min=1)
    floor = probs.gather(1, num_keep - 1)
    return (probs >= floor) | (top_p >= 1.0).unsqueeze(1)
