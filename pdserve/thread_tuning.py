"""How many torch threads a decode step should use, measured on this machine at start-up.

Prefill is compute bound and scales with cores. A decode step of a small model does not: it is a
chain of short ops, and on a few cores its extra threads mostly spin at barriers on cores that the
event loop, HTTP, the router and the peer worker need (measured on 2 cores: "tiny" decode steps
take the same time with 1 and 2 threads, and serving with 1 decode thread gave 1.3-1.6x the
tokens/s). A big model's decode step does scale ("small": 2.3x at batch 8). So the runner times a
few decode steps with 1 thread and with all of them, interleaved, and keeps more threads only when
they pay.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# Extra threads must make a decode step this much faster to be worth the cores they take from the
# rest of the server (the event loop shares the GIL and the cores with the runner thread).
MIN_THREAD_SPEEDUP = 1.3
# A step this long on one thread is matmul bound and its threads always pay ("small": 64 ms on one
# thread, 28 ms on two at batch 8), even when a busy machine at start-up (a peer worker loading its
# weights) hides the gain from the timing. "tiny" takes ~6 ms: a wide margin on both sides.
MIN_SINGLE_THREAD_STEP_S = 0.02
CALIBRATION_BATCH = 8
CALIBRATION_CONTEXT = 64  # tokens per calibration sequence
NUM_TRIALS = 5


def should_calibrate(
    role: str, device_type: str, configured_threads: int | None, prefill_threads: int
) -> bool:
    """Whether a worker times its decode threads at start-up: only CPU workers that decode,
    were given no count and have more than one thread to choose from (on CUDA the host
    threads only launch kernels)."""
    return (
        device_type == "cpu"
        and role != "prefill"
        and configured_threads is None
        and prefill_threads > 1
    )


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    step_s: dict[int, float]  # best decode step time per candidate thread count

    def describe(self) -> str:
        steps = ", ".join(f"{n} thread(s) {s * 1e3:.2f} ms" for n, s in sorted(self.step_s.items()))
        return f"decode threads {self.threads} (best step: {steps})"


def choose_threads(
    step_s: dict[int, float],
    min_speedup: float = MIN_THREAD_SPEEDUP,
    min_single_thread_step_s: float = MIN_SINGLE_THREAD_STEP_S,
) -> int:
    """All candidate threads when a one-thread step is long; otherwise the fewest threads such
    that every larger candidate is less than ``min_speedup`` faster."""
    if step_s.get(1, 0.0) >= min_single_thread_step_s:
        return max(step_s)
    chosen = min(step_s)
    for threads in sorted(step_s):
        if step_s[chosen] >= step_s[threads] * min_speedup:
            chosen = threads
    return chosen


def time_candidates(
    step: Callable[[], object],
    set_threads: Callable[[int], None],
    candidates: list[int],
    num_trials: int = NUM_TRIALS,
) -> dict[int, float]:
    """Best time of ``step`` per thread count; candidates alternate so both see the same load."""
    best = {n: float("inf") for n in candidates}
    for _ in range(num_trials):
        for n in candidates:
            set_threads(n)
            t0 = time.perf_counter()
            step()
            best[n] = min(best[n], time.perf_counter() - t0)
    return best
