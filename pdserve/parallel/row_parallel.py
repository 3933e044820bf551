"""A row-parallel projection (o_proj, down) whose sum has the same bits at every TP size.

Each of the rank's K segments (:func:`~pdserve.parallel.mapping.row_segments`) runs the
ordinary projection kernel on its input columns; the partials are combined in one balanced
pairwise tree, the rank's subtree first and then, over the ranks' gathered subtree sums, the
top of the same tree; the bias is added once, after it. A ring all-reduce would be faster to
reach for and gives sums in an order that depends on the TP size: that is what this avoids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.kernels.linear import Linear
from pdserve.parallel.mapping import KSegment


class Gather(Protocol):
    """The rank group's all-gather, in rank order (``pdserve.parallel.group.TPGroup``)."""

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class TP:
    """A rank's place in its tensor-parallel group (rank 0 of 1: no tensor parallelism)."""

    rank: int = 0
    size: int = 1
    group: Gather | None = None
    # rank 0: tells the other ranks to join an LM head call over this many rows
    announce_logits: Callable[[int], None] | None = None


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` (a power-of-two count) summed pairwise: ``((p0+p1)+(p2+p3))+...``."""
    if len(parts) & (len(parts) - 1):
        raise ValueError(f"tree_sum needs a power-of-two count, got {len(parts)}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


class RowParallelLinear:
    """``y = x @ W.T + bias`` for the rank's input slice ``x``, summed over every rank."""

    def __init__(
        self,
        segments: list[KSegment],
        bias: torch.Tensor | None,
        act_dtype: torch.dtype,
        group: Gather | None = None,
    ) -> None:
        self.pieces = [Linear(s.weight, None, act_dtype) for s in segments]
        self.segments = [(s.lo, s.hi, s.pad_before, s.pad_after) for s in segments]
        self.bias = bias.to(act_dtype) if bias is not None else None
        self.group = group

    def _segment_input(self, x: torch.Tensor, i: int) -> torch.Tensor:
        lo, hi, before, after = self.segments[i]
        if not before and not after:
            return x[:, lo:hi].contiguous()
        padded = x.new_zeros(x.shape[0], before + hi - lo + after)
        padded[:, before : before + hi - lo] = x[:, lo:hi]
        return padded

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = tree_sum([p(self._segment_input(x, i)) for i, p in enumerate(self.pieces)])
        if self.group is not None:
            y = tree_sum(self.group.all_gather(y))
        return y + self.bias if self.bias is not None else y

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.pieces)
