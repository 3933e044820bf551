"""A row-parallel projection over real K-quant blocks gives TP1's bits at TP2 and TP4, whether
its segments cut blocks (padded with zeros) or fall on block bounds (uneven MLP shares).

The ranks are threads here (the kernels release the GIL) around a barrier-backed all-gather:
the same RowParallelLinear code the rank processes run, without starting any."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.kernels import cpu_ext
from pdserve.parallel.mapping import mlp_bounds, row_segments
from pdserve.parallel.row_parallel import RowParallelLinear
from tests.kernels.test_quant_gemm import random_weight


class ThreadGather:
    """All-gather among ``size`` threads (rank = the thread's index)."""

    def __init__(self, size: int) -> None:
        self.size, self._slots = size, [torch.empty(0)] * size
        self._posted, self._read = threading.Barrier(size), threading.Barrier(size)
        self.rank_of: dict[int, int] = {}

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        self._slots[self.rank_of[threading.get_ident()]] = t.clone()
        self._posted.wait(timeout=30)
        out = list(self._slots)
        self._read.wait(timeout=30)
        return out


def _tp_outputs(weight, k: int, segments: int, tp: int, x: torch.Tensor, bounds) -> torch.Tensor:  # noqa: ANN001
    bias = torch.linspace(-1, 1, weight.shape[0])
    if tp == 1:
        layer = RowParallelLinear(
            row_segments(weight, k, segments, 1, 0, bounds), bias, torch.float32
        )
        return layer(x)
    gather, results = ThreadGather(tp), [torch.empty(0)] * tp
    layers = [
        RowParallelLinear(
            row_segments(weight, k, segments, tp, r, bounds), bias, torch.float32, gather
        )
        for r in range(tp)
    ]

    def run(r: int) -> None:
        gather.rank_of[threading.get_ident()] = r
        lo = layers[r].segments[0][0]
        start = (bounds or [k * j // segments for j in range(segments + 1)])[r * segments // tp]
        width = layers[r].segments[-1][1] - lo
        results[r] = layers[r](x[:, start : start + width])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(torch.equal(results[0], r) for r in results)  # every rank holds the sum
    return results[0]


@pytest.mark.skipif(cpu_ext.load() is None, reason="the quantized kernel needs the C++ module")
@pytest.mark.parametrize(
    ("kind", "k", "segments", "aligned"),
    [("Q4_K", 4864, 2, False), ("Q4_K", 4864, 2, True), ("Q6_K", 8960, 4, True),
     ("Q4_K", 1536, 4, False), ("Q5_0", 896, 2, False)],
)  # fmt: skip
def test_row_parallel_k_quant_sums_have_tp1_s_bits_at_every_tp_size(
    kind: str, k: int, segments: int, aligned: bool
) -> None:
    weight = random_weight(kind, 48, k, seed=3)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
    bounds = mlp_bounds(k, segments, 256) if aligned else None
    tp1 = _tp_outputs(weight, k, segments, 1, x, bounds)
    for tp in (2, 4):
        if segments % tp == 0:
            assert torch.equal(_tp_outputs(weight, k, segments, tp, x, bounds), tp1), tp
    dense = x.double() @ weight.dequantize().double().T + torch.linspace(-1, 1, 48).double()
    assert torch.allclose(tp1.double(), dense, rtol=1e-4, atol=1e-3)  # and it is the product
