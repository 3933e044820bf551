"""Logits edits before sampling: logit_bias, min_tokens suppression, grammar bitmasks."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_ext, logits_processors
from pdserve.kernels.logits_processors import bitmask_bias, logits_processing_for, unpack_bitmask
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence

CPU = torch.device("cpu")
EOS = frozenset({7})
DEVICES = [CPU] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def _seq(num_generated: int = 0, **params: object) -> Sequence:
    ids = [1, 2, 3] + [4] * num_generated
    return Sequence("s", ids, 3, SamplingParams(**params))  # type: ignore[arg-type]


class FixedMatcher:
    """A matcher double that allows a fixed token set (the bitmask contract only)."""

    def __init__(self, allowed: set[int], vocab_size: int) -> None:
        self.allowed, self.vocab_size = allowed, vocab_size

    def bitmask(self) -> torch.Tensor:
        row = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        for t in self.allowed:
            word, bit = divmod(t, 32)
            value = int(row[word]) | (1 << bit)
            row[word] = value - (1 << 32) if value >= 1 << 31 else value
        return row


def test_nothing_to_do_means_no_processing_at_all() -> None:
    seqs = [_seq(), _seq(5, min_tokens=2), _seq(temperature=0.5)]
    assert logits_processing_for(seqs, EOS, CPU) is None


def test_unpack_bitmask_reads_bit_v_mod_32_of_word_v_div_32() -> None:
    bitmask = torch.tensor([[0b101 - 2**31, 0], [0, 1]], dtype=torch.int32)
    allowed = unpack_bitmask(bitmask, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 31]
    assert allowed[1].nonzero().flatten().tolist() == [32]


@pytest.mark.parametrize("vocab,width", [(70, 70), (70, 96), (70, 50)])
def test_bitmask_bias_is_zero_exactly_at_allowed_ids_below_the_vocabulary(vocab, width) -> None:
    gen = torch.Generator().manual_seed(vocab + width)
    bitmask = torch.randint(-(2**31), 2**31, (3, 3), dtype=torch.int32, generator=gen)
    bias = bitmask_bias(bitmask, vocab, width, torch.float32)
    assert bias.shape == (3, width)
    for r in range(3):
        words = [int(w) & 0xFFFFFFFF for w in bitmask[r]]
        want = [v < vocab and bool(words[v // 32] >> (v % 32) & 1) for v in range(width)]
        assert (bias[r] == 0).tolist() == want
        assert torch.isinf(bias[r][~torch.tensor(want)]).all()


def test_logit_bias_adds_per_row() -> None:
    logits = torch.zeros(2, 10)
    seqs = [_seq(logit_bias={3: 5.0, 9: -100.0}), _seq()]
    out = logits_processing_for(seqs, EOS, CPU).apply(logits)
    assert out[0, 3] == 5.0 and out[0, 9] == -100.0 and out[0].abs().sum() == 105.0
    assert out[1].abs().sum() == 0


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    seqs = [
        _seq(1, min_tokens=3, stop_token_ids=[5]),
        _seq(3, min_tokens=3, stop_token_ids=[5]),  # reached: untouched
        _seq(0, min_tokens=2, ignore_eos=True, stop_token_ids=[6]),
    ]
    out = logits_processing_for(seqs, EOS, CPU).apply(torch.zeros(3, 10))
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [5, 7]
    assert not torch.isinf(out[1]).any()
    assert torch.isinf(out[2]).nonzero().flatten().tolist() == [6]


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_grammar_rows_keep_only_allowed_tokens_and_no_padded_ids(device: torch.device) -> None:
    vocab, width = 40, 48  # the model's logits are wider than the tokenizer's vocabulary
    constrained = _seq(logit_bias={33: 1.0})
    constrained.grammar = FixedMatcher({0, 33, 39}, vocab)  # type: ignore[assignment]
    free = _seq(1, min_tokens=2)
    logits = torch.zeros(2, width, device=device)
    out = logits_processing_for([free, constrained], EOS, device).apply(logits).cpu()
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [7]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [0, 33, 39]
    assert out[1, 33] == 1.0


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_every_row_constrained_masks_each_row_by_its_own_matcher(device: torch.device) -> None:
    vocab = 40
    seqs = [_seq(), _seq()]
    seqs[0].grammar = FixedMatcher({1, 2}, vocab)  # type: ignore[assignment]
    seqs[1].grammar = FixedMatcher({35}, vocab)  # type: ignore[assignment]
    logits = torch.zeros(2, vocab, device=device)
    out = logits_processing_for(seqs, EOS, device).apply(logits).cpu()
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [1, 2]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [35]


def _random_bitmask_rows(rows: int, words: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    masks = torch.randint(-(2**31), 2**31, (rows, words), dtype=torch.int32, generator=gen)
    masks[0, 0] = -1  # a word allowing all 32 (the kernel's skip) and one allowing none
    masks[-1, -1] = 0
    return list(masks)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("vocab,width", [(70, 70), (70, 96), (70, 50), (32000, 32064), (13, 13)])
def test_the_cpu_kernel_masks_exactly_what_the_torch_bias_masks(vocab: int, width: int) -> None:
    masks = _random_bitmask_rows(3, (vocab + 31) // 32, vocab + width)
    rows = [3, 0, 2]  # not in order, one row left alone
    logits = torch.randn(4, width, generator=torch.Generator().manual_seed(1))
    expected = logits.clone()
    expected[rows] += bitmask_bias(torch.stack(masks), vocab, width, torch.float32)
    cpu_ext.load().apply_token_bitmask_(logits, masks, rows, vocab)
    assert torch.equal(logits, expected)


def test_grammar_masks_without_the_cpu_kernel_use_the_torch_bias(monkeypatch) -> None:
    monkeypatch.setattr(logits_processors, "_bitmask_kernel_for", lambda logits: None)
    test_grammar_rows_keep_only_allowed_tokens_and_no_padded_ids(CPU)
    test_every_row_constrained_masks_each_row_by_its_own_matcher(CPU)
