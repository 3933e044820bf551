"""Prompt logprobs: row p of the prefill predicts token p + 1, chunked over the LM head."""

from __future__ import annotations

import torch

from pdserve.kernels import prompt_logprobs as module
from pdserve.kernels.attention import PrefillSeqMeta
from pdserve.kernels.prompt_logprobs import prompt_logprobs_for
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence


def test_entries_match_a_full_log_softmax_and_chunking(monkeypatch) -> None:
    torch.manual_seed(0)
    head = torch.randn(8, 11)  # hidden 8 -> vocab 11
    hidden = torch.randn(9, 8)  # two packed sequences: 5 + 4 rows
    seqs = [
        Sequence("a", [1, 4, 2, 9, 3], 5, SamplingParams(prompt_logprobs=2)),
        Sequence("b", [5, 6, 7, 8], 4, SamplingParams()),
    ]
    metas = [
        PrefillSeqMeta(q_start=0, num_new=5, num_cached=0, page_ids=torch.zeros(1)),
        PrefillSeqMeta(q_start=5, num_new=4, num_cached=0, page_ids=torch.zeros(1)),
    ]
    monkeypatch.setattr(module, "CHUNK_ROWS", 3)  # 4 predictions: chunks of 3 and 1
    out = prompt_logprobs_for(lambda h: h @ head, hidden, metas, seqs)
    assert out[1] is None
    entries = out[0]
    assert entries is not None and len(entries) == 5 and entries[0] is None
    reference = (hidden[:4] @ head).log_softmax(dim=1)
    for pos in range(1, 5):
        entry = entries[pos]
        token = seqs[0].token_ids[pos]
        assert entry.token_id == token
        assert abs(entry.logprob - reference[pos - 1, token].item()) < 1e-5
        top = reference[pos - 1].topk(2)
        assert [t for t, _ in entry.top] == top.indices.tolist()
