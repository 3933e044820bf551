"""Sampler: greedy, seeded noise, truncation, penalties, logprobs, batch construction."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels.sampling import (
    SamplingTensors,
    _filter_top_k_top_p,
    _mix32,
    _mix32_int32,
    apply_penalties,
    is_plain_greedy,
    sample,
    sampling_tensors_for,
    uniform_noise,
)
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence


def _tensors(n: int, **over: object) -> SamplingTensors:
    base: dict[str, object] = {
        "temperature": torch.ones(n),
        "top_k": torch.zeros(n, dtype=torch.int64),
        "top_p": torch.ones(n),
        "seeds": torch.arange(n, dtype=torch.int64),
        "positions": torch.full((n,), 5, dtype=torch.int64),
        "repetition_penalty": torch.ones(n),
        "frequency_penalty": torch.zeros(n),
        "presence_penalty": torch.zeros(n),
    }
    return SamplingTensors(**(base | over))  # type: ignore[arg-type]


def test_noise_is_a_function_of_seed_position_and_vocab_index_only() -> None:
    seeds = torch.tensor([7, 7, 8, 2**32 - 1])
    positions = torch.tensor([3, 4, 3, 3])
    noise = uniform_noise(seeds, positions, 1000)
    again = uniform_noise(seeds[[2, 0]], positions[[2, 0]], 1000)
    assert torch.equal(noise[[2, 0]], again)
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert noise.min() > 0 and noise.max() < 1
    assert abs(noise.mean().item() - 0.5) < 0.02


def test_sampling_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    num = 4000
    t = _tensors(num, seeds=torch.arange(num, dtype=torch.int64))
    tokens = sample(probs.log().expand(num, 4).clone(), t).token_ids
    freq = torch.bincount(tokens, minlength=4).float() / num
    # 4 standard errors of a binomial proportion at n=4000 is < 0.032.
    assert torch.allclose(freq, probs, atol=0.032), freq


def test_temperature_zero_is_argmax_and_ignores_noise() -> None:
    logits = torch.randn(6, 50)
    t = _tensors(6, temperature=torch.zeros(6))
    assert torch.equal(sample(logits, t).token_ids, logits.argmax(1))


def test_top_k_keeps_only_k_candidates() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]]).expand(500, 5).clone()
    t = _tensors(500, top_k=torch.full((500,), 2), temperature=torch.full((500,), 5.0))
    assert set(sample(logits, t).token_ids.tolist()) == {0, 1}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    t = _tensors(500, top_p=torch.full((500,), 0.8))
    tokens = sample(probs.log().expand(500, 4).clone(), t).token_ids
    assert set(tokens.tolist()) == {0, 1}  # 0.6 < 0.8 <= 0.85


def test_rows_mix_greedy_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7], [0.4, 0.35, 0.25], [0.3, 0.3, 0.4]]))
    t = _tensors(3, temperature=torch.tensor([0.0, 1.0, 1.0]), top_k=torch.tensor([0, 1, 0]))
    t.top_p = torch.tensor([1.0, 1.0, 0.3])
    assert sample(logits, t).token_ids.tolist() == [2, 0, 2]


def test_penalties_follow_hf_and_openai_definitions() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    t = _tensors(
        1,
        repetition_penalty=torch.tensor([2.0]),
        frequency_penalty=torch.tensor([0.5]),
        presence_penalty=torch.tensor([0.25]),
    )
    t.prompt_tokens = torch.tensor([[0, -1]])  # token 0 in the prompt
    t.output_tokens = torch.tensor([[1, 2, 2]])  # token 1 once, token 2 twice
    out = apply_penalties(logits, t)[0].tolist()
    assert out == pytest.approx([1.0, -4.0 - 0.5 - 0.25, 0.5 - 1.0 - 0.25, 0.5])


def test_logprobs_and_top_logprobs() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    t = _tensors(1, temperature=torch.zeros(1))
    t.need_logprobs, t.max_top_logprobs = True, 2
    out = sample(logits, t)
    expected = logits.log_softmax(1)[0]
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    assert out.logprobs.item() == pytest.approx(expected[1].item())
    assert out.top_ids.tolist() == [[1, 2]]
    assert math.isclose(out.top_logprobs[0, 1].item(), expected[2].item(), rel_tol=1e-6)


def test_sampling_tensors_from_sequences() -> None:
    seqs = [
        Sequence(
            "a", [1, 2, 3], 2, SamplingParams(temperature=0.5, seed=-1, frequency_penalty=1.0)
        ),
        Sequence("b", [4], 1, SamplingParams(top_k=1, logprobs=True, top_logprobs=3)),
    ]
    t = sampling_tensors_for(seqs, torch.device("cpu"))
    assert t.temperature.tolist() == [0.5, 0.0]  # top_k=1 is greedy
    assert t.positions.tolist() == [3, 1]
    assert t.seeds[0].item() == 0  # -1 folds to 0: all 64 bits set, xor-folded
    assert (t.need_logprobs, t.max_top_logprobs) == (True, 3)
    assert t.prompt_tokens is not None and t.output_tokens is not None
    assert t.prompt_tokens.tolist() == [[1, 2], [4, -1]]
    assert t.output_tokens.tolist() == [[3], [-1]]


def test_unseeded_requests_draw_fresh_seeds() -> None:
    seqs = [Sequence(str(i), [1], 1, SamplingParams(seed=None)) for i in range(4)]
    t = sampling_tensors_for(seqs, torch.device("cpu"))
    assert len(set(t.seeds.tolist())) > 1
    assert t.prompt_tokens is None  # no penalties requested: no history tensors


def _sorted_nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    """The nucleus by the textbook full-sort definition (masses summed in float64, so that
    float32 rounding does not decide tokens at the boundary)."""
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True)
    sorted_probs = probs[order].double()
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    return set(order[mass_before < torch.tensor(top_p, dtype=torch.float32).double()].tolist())


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_mask_equals_full_sort_nucleus_short_and_long(top_p: float) -> None:
    gen = torch.Generator().manual_seed(0)
    peaked = torch.randn(3, 5000, generator=gen) * 6  # nucleus inside the first guess
    flat = torch.randn(3, 5000, generator=gen) * 0.1  # nucleus of thousands of tokens
    logits = torch.cat([peaked, flat])
    t = _tensors(6, top_p=torch.full((6,), top_p))
    kept = _filter_top_k_top_p(logits, t).isfinite()
    for row in range(6):
        assert set(kept[row].nonzero().squeeze(1).tolist()) == _sorted_nucleus(logits[row], top_p)


def test_top_k_applies_before_top_p_and_rows_without_filters_are_untouched() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]))
    t = _tensors(2, top_k=torch.tensor([2, 0]), top_p=torch.tensor([0.5, 1.0]))
    out = _filter_top_k_top_p(logits, t)
    # Row 0: top-2 renormalised is (4/7, 3/7): 4/7 >= 0.5 already, so only token 0 is left.
    assert out[0].isfinite().tolist() == [True, False, False, False]
    assert torch.equal(out[1], logits[1])


def test_noise_for_given_ids_equals_the_matching_columns() -> None:
    seeds, positions = torch.tensor([3, 4]), torch.tensor([10, 11])
    ids = torch.tensor([[5, 0, 99], [7, 7, 1]])
    full = uniform_noise(seeds, positions, 100)
    assert torch.equal(uniform_noise(seeds, positions, ids), full.gather(1, ids))


def test_truncated_sampling_equals_the_full_vocabulary_race() -> None:
    # top-k = 3 leaves few candidates, so noise is hashed for those ids only; the choice must
    # equal the race over the whole vocabulary with the full noise.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 500, generator=gen)
    t = _tensors(200, top_k=torch.full((200,), 3), seeds=torch.arange(200))
    picked = sample(logits, t).token_ids
    top3 = logits.topk(3, dim=1).indices
    masked = torch.full_like(logits, float("-inf")).scatter(1, top3, logits.gather(1, top3))
    noise = uniform_noise(t.seeds, t.positions, 500)
    expected = (masked - torch.log(-torch.log(noise))).argmax(dim=1)
    assert torch.equal(picked, expected)
    assert len(set(picked.tolist())) > 3  # rows differ, but each picks within its top 3


def test_int32_hash_has_the_bits_of_the_int64_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.cat(
        [torch.randint(0, 2**32, (5000,), generator=gen), torch.tensor([0, 2**32 - 1])]
    )
    signed = torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)
    got = _mix32_int32(signed).to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(got, _mix32(values))


def test_plain_greedy_means_greedy_without_penalties_or_logprobs() -> None:
    def seq(**params: object) -> Sequence:
        return Sequence("s", [1, 2], 2, SamplingParams(**params))  # type: ignore[arg-type]

    assert is_plain_greedy([seq(temperature=0.0), seq(top_k=1, temperature=0.7)])
    assert not is_plain_greedy([seq(temperature=0.0), seq(temperature=0.7)])
    assert not is_plain_greedy([seq(temperature=0.0, logprobs=True)])
    assert not is_plain_greedy([seq(temperature=0.0, presence_penalty=0.5)])
    assert not is_plain_greedy([seq(temperature=0.0, repetition_penalty=1.2)])


def test_all_greedy_batch_is_the_first_argmax_even_with_ties() -> None:
    logits = torch.randn(5, 1000).bfloat16().float()
    logits[2, [10, 700]] = 50.0  # tie: the lower id wins, as with argmax
    t = _tensors(5, temperature=torch.zeros(5))
    assert torch.equal(sample(logits, t).token_ids, logits.argmax(dim=1))
    assert sample(logits, t).token_ids[2] == 10


def test_min_p_keeps_tokens_within_a_factor_of_the_best() -> None:
    # p = softmax([ln 8, ln 4, ln 2, ln 1]) = [8, 4, 2, 1] / 15; min_p 0.3 keeps 8 and 4 only.
    logits = torch.tensor([[math.log(8), math.log(4), math.log(2), 0.0]]).repeat(400, 1)
    t = _tensors(400, min_p=torch.full((400,), 0.3), positions=torch.arange(400))
    drawn = set(sample(logits, t).token_ids.tolist())
    assert drawn == {0, 1}
    # Temperature flattens first: at T=2, p ~ [2.83, 2, 1.41, 1]; 0.3 x 2.83 = 0.85 keeps all.
    hot = _tensors(400, min_p=torch.full((400,), 0.3), temperature=torch.full((400,), 2.0),
                   positions=torch.arange(400))  # fmt: skip
    assert set(sample(logits, hot).token_ids.tolist()) == {0, 1, 2, 3}


def test_min_p_tensor_only_when_some_row_uses_it() -> None:
    plain = Sequence("a", [1, 2], 2, SamplingParams(temperature=1.0))
    with_min_p = Sequence("b", [1, 2], 2, SamplingParams(temperature=1.0, min_p=0.1))
    assert sampling_tensors_for([plain], torch.device("cpu")).min_p is None
    t = sampling_tensors_for([plain, with_min_p], torch.device("cpu"))
    assert t.min_p is not None and t.min_p.tolist() == pytest.approx([0.0, 0.1])
