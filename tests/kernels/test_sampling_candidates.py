"""The candidate race: the same token as the full-vocabulary path, or an honest fallback."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.sampling import _full_vocab_sample, _random_sample
from pdserve.kernels.sampling_candidates import CANDIDATE_WIDTH, plan_candidates
from pdserve.kernels.sampling_tensors import SamplingTensors

VOCAB = 4096


def _tensors(n: int, temperature: float, top_k: int, top_p: float, seed: int) -> SamplingTensors:
    gen = torch.Generator().manual_seed(seed)
    return SamplingTensors(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k),
        top_p=torch.full((n,), top_p),
        seeds=torch.randint(0, 2**32, (n,), generator=gen),
        positions=torch.randint(0, 1000, (n,), generator=gen),
        repetition_penalty=torch.ones(n),
        frequency_penalty=torch.zeros(n),
        presence_penalty=torch.zeros(n),
    )


@pytest.mark.parametrize("scale", [0.2, 2.0, 10.0])  # flat .. peaked distributions
@pytest.mark.parametrize(
    ("top_k", "top_p", "temperature"),
    [(0, 1.0, 1.0), (0, 0.9, 0.7), (40, 1.0, 1.3), (50, 0.95, 0.8), (63, 0.5, 1.0), (200, 0.9, 1)],
)
def test_candidate_sampling_picks_the_full_vocabulary_token(
    scale: float, top_k: int, top_p: float, temperature: float
) -> None:
    gen = torch.Generator().manual_seed(int(scale * 10) + top_k)
    # bf16-rounded logits: many ties at the top-k and top-p boundaries.
    logits = (torch.randn(64, VOCAB, generator=gen) * scale).bfloat16().float()
    t = _tensors(64, temperature, top_k, top_p, seed=top_k)
    assert torch.equal(_random_sample(logits, t), _full_vocab_sample(logits, t))


def test_peaked_rows_are_exact_and_flat_rows_fall_back() -> None:
    gen = torch.Generator().manual_seed(0)
    peaked = torch.randn(4, VOCAB, generator=gen) * 10
    flat = torch.randn(4, VOCAB, generator=gen) * 0.1
    t = _tensors(8, 1.0, 0, 0.9, seed=0)
    plan = plan_candidates(torch.cat([peaked, flat]), t.temperature, t.top_k, t.top_p)
    assert plan.ids.shape == (8, CANDIDATE_WIDTH)
    assert plan.is_exact.tolist() == [True] * 4 + [False] * 4
    # Greedy rows (temperature 0) are decided elsewhere: never sent down the slow path.
    greedy = plan_candidates(flat, torch.zeros(4), t.top_k[:4], t.top_p[:4])
    assert bool(greedy.is_exact.all())


def test_top_k_ties_beyond_the_candidates_fall_back() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, :10] = 1.0  # 10 clear leaders, then 4086 tokens tied at the 20th place
    t = _tensors(1, 1.0, 20, 1.0, seed=1)
    assert not bool(plan_candidates(logits, t.temperature, t.top_k, t.top_p).is_exact[0])
    t.top_k = torch.tensor([5])
    plan = plan_candidates(logits, t.temperature, t.top_k, t.top_p)
    assert bool(plan.is_exact[0]) and int(plan.scaled.isfinite().sum()) == 10  # ties kept
