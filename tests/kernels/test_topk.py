"""Block argmax / top-k: exactly torch's answers, including ties and ragged row widths."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.topk import argmax_rows, topk_rows


@pytest.mark.parametrize("vocab", [32000, 50257, 300, 100])
def test_argmax_rows_equals_argmax_first_index_on_ties(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    # bf16-rounded logits tie often; the first maximal index must win, as in argmax.
    logits = (torch.randn(16, vocab, generator=gen) * 0.3).bfloat16().float()
    logits[3] = 1.0  # every entry tied: id 0
    logits[4, -1] = 99.0  # the max in the ragged tail (or the last block)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=1))
    assert argmax_rows(logits)[3] == 0 and argmax_rows(logits)[4] == vocab - 1


@pytest.mark.parametrize(("vocab", "k"), [(32000, 1), (32000, 50), (32000, 64), (50257, 64)])
def test_topk_rows_gives_the_exact_top_values_and_their_ids(vocab: int, k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(8, vocab, generator=gen).bfloat16().float()
    values, ids = topk_rows(logits, k)
    assert torch.equal(values, logits.topk(k, dim=1).values)
    assert torch.equal(logits.gather(1, ids), values)
    assert all(len(set(row)) == k for row in ids.tolist())  # no id twice
