"""Projection matmuls of one decode step: torch bf16 vs the bf16 kernel vs oneDNN float32.

Run: ``python bench/linear_bench.py [--rows 1,8,16,32] [--threads 2] [--reps 15]``.
The weights are the 33 projections of issue 3's "small" config (8 layers of QKV 1536x1024,
O 1024x1024, gate/up 5632x1024, down 1024x2816, plus the 32000x1024 LM head: 246 MB of bf16),
so one pass streams them from memory like a real step. The three paths run interleaved rep by
rep (a busy machine slows all alike); min and median ms per pass, and the kernel's effective
weight bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_ext, cpu_gemm

SMALL_SHAPES = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)] * 8 + [(32000, 1024)]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,16,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    module = cpu_ext.load()
    if module is None:
        raise SystemExit("the bf16 kernel is unavailable here (needs AVX2 and a C++ compiler)")
    weights = [torch.randn(n, k).bfloat16() for n, k in SMALL_SHAPES]
    packed = [cpu_gemm.PackedDenseWeight(module, w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w.float(), None) for w in weights]
    weight_bytes = sum(w.numel() * 2 for w in weights)
    print(f"{len(weights)} projections, {weight_bytes / 1e6:.0f} MB bf16, {args.threads} threads")
    print(f"{'rows':>4}  {'torch bf16':>16}  {'kernel':>16}  {'oneDNN f32':>16}  kernel GB/s")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, w.shape[1]).bfloat16() for w in weights]
        paths = {
            "torch": (F.linear, weights),
            "kernel": (lambda x, p: p(x, None, x.dtype), packed),
            "onednn": (
                lambda x, w: torch.ops.mkldnn._linear_pointwise(x.float(), w, None, "none", [], ""),
                onednn,
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.reps):
            for name, (fn, ws) in paths.items():
                times[name].append(timed(lambda fn=fn, ws=ws, xs=xs: one_pass(fn, xs, ws)))
        cells = [f"{min(t):7.2f} /{statistics.median(t):7.2f}" for t in times.values()]
        bandwidth = weight_bytes / min(times["kernel"]) / 1e6
        print(f"{rows:>4}  " + "  ".join(f"{c:>16}" for c in cells) + f"  {bandwidth:9.1f}")


def one_pass(fn: Callable, xs: list[torch.Tensor], weights: list) -> None:
    for x, w in zip(xs, weights, strict=True):
        fn(x, w)


if __name__ == "__main__":
    main()
