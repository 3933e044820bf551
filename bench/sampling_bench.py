"""Sampling step time on this machine: parameters built, tokens sampled, results on the host.

    python bench/sampling_bench.py [--device cpu] [--vocab 32000] [--batches 1,8,64]

One step is what the model runner does after the forward: ``sampling_tensors_for`` (one host
buffer, one copy), ``sample`` and the one host copy of the results. Median of ``--repeats``.
``--thread-time`` times the calling thread's CPU time instead of the wall clock: with one torch
thread (``OMP_NUM_THREADS=1``) all the work runs there, and a busy shared machine then moves
the figures much less.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.kernels.host_copy import PendingHostSample  # noqa: E402
from pdserve.kernels.sampling import sample, sampling_tensors_for  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.sequence import Sequence  # noqa: E402

CASES = {
    "temperature": SamplingParams(temperature=0.8, seed=1),
    "top_k_top_p": SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=1),
    "top_p_flat": SamplingParams(temperature=1.5, top_p=0.95, seed=1),
    "penalties_logprobs": SamplingParams(
        temperature=0.9, repetition_penalty=1.2, presence_penalty=0.5, logprobs=True,
        top_logprobs=5, seed=1,
    ),
}  # fmt: skip


def step_ms(
    logits: torch.Tensor, seqs: list[Sequence], repeats: int, clock: Callable[[], float]
) -> float:
    times = []
    for _ in range(repeats):
        t0 = clock()
        t = sampling_tensors_for(seqs, logits.device)
        PendingHostSample(sample(logits, t)).wait()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--thread-time", action="store_true", help="CPU time of this thread")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of the cases")
    args = p.parse_args(argv)
    clock = time.thread_time if args.thread_time else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    print(f"{'case':<20}{'batch':>6}{'ms/step':>10}")
    for name in args.cases.split(","):
        params = CASES[name]
        for batch in (int(b) for b in args.batches.split(",")):
            logits = (torch.randn(batch, args.vocab, generator=gen) * 3).to(args.device)
            seqs = [Sequence(f"s{i}", list(range(100 + i)), 90, params) for i in range(batch)]
            step_ms(logits, seqs, 2, clock)  # warm-up
            print(f"{name:<20}{batch:>6}{step_ms(logits, seqs, args.repeats, clock):>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
