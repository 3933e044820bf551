"""The LM head split by vocabulary across the tensor-parallel ranks, gathered on rank 0.

At TP1 the head is the largest single matmul of a small model's decode step (Qwen2.5-0.5B:
151,936 x 896, about a third of the bytes a step reads); on rank 0 alone it would leave the
other ranks idle for that long. Rank r computes rows ``[r*w, (r+1)*w)`` of the vocabulary
(``w = ceil(V / t)``; the last shard's missing rows are zero padding, cut off again): a column
split, so every logit is the same fma chain as at TP1 and keeps its bits.

Only rank 0 knows which rows need logits (the last token of each prompt, every decode row,
prompt-logprob chunks): it announces the row count to the other ranks (a LOGITS step) and
hands them its normed rows through one all-gather, then every rank computes its shard and a
second all-gather brings the shards to rank 0.
"""

from __future__ import annotations

import torch

from pdserve.kernels.linear import Linear
from pdserve.model.weights import Projection
from pdserve.parallel.mapping import take_rows
from pdserve.parallel.row_parallel import TP


class VocabParallelHead:
    """``x @ W.T`` over the whole vocabulary on rank 0 (None elsewhere); ``x`` is rank 0's
    rows, or on the other ranks a placeholder of their shape."""

    def __init__(self, weight: Projection, vocab_size: int, act_dtype: torch.dtype, tp: TP) -> None:
        assert tp.group is not None, "a vocab-parallel head needs its rank group"
        self.tp, self.group, self.vocab_size = tp, tp.group, vocab_size
        self.width = -(-vocab_size // tp.size)
        lo, hi = tp.rank * self.width, min(vocab_size, (tp.rank + 1) * self.width)
        self.linear = Linear(take_rows(weight, [(lo, hi)]), None, act_dtype)
        self.num_rows = hi - lo

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.tp.announce_logits is not None:
            self.tp.announce_logits(x.shape[0])
        x = self.group.all_gather(x)[0]  # rank 0's rows, on every rank
        y = self.linear(x)
        if self.num_rows < self.width:
            y = torch.nn.functional.pad(y, (0, self.width - self.num_rows))
        shards = self.group.all_gather(y)
        if self.tp.rank != 0:
            return None
        return torch.cat(shards, dim=1)[:, : self.vocab_size]

    @property
    def num_bytes(self) -> int:
        return self.linear.num_bytes
