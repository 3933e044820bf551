"""What this CPU can do, against what the bf16 decode GEMM's inner loop gets.

    python bench/cpu_peak.py [--threads 2]

Builds a small C++ module (torch's cpp_extension, cached under ~/.cache/pdserve/cpu_peak) and
prints:

* the float32 FMA latency and peak: 1 and 10 independent AVX2 FMA chains per thread, registers
  only, each chain seeded differently (identical chains are one chain to the compiler: an earlier
  version of this script measured one latency-bound chain and reported it as 1.5x the peak), on
  1 and on ``--threads`` threads at once;
* the GEMM's inner loop (``csrc/dense_gemm.cpp``: a 16-column bf16 panel widened by shift/and,
  the rows' inputs side by side and broadcast from memory), one thread, for 4 and 6 rows: on one
  cached 32 KB panel, and streaming 64 MB of panels from memory without and with the kernel's 2 KiB
  software prefetch. Medians of interleaved rounds (a shared machine slows every variant alike).

The gap between the cached loop and the peak is the micro-kernel's; the gap between the streamed
and the cached loop is the memory system's (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <immintrin.h>
#include <torch/extension.h>

// `chains` (1 or 10) independent FMA chains, each seeded differently. Named variables, not an
// array: GCC keeps arrays of vectors on the stack, and the loop would time stores.
double fma_chains(int64_t chains, int64_t iters) {
#define SEED(i) __m256 a##i = _mm256_set1_ps(1.0f + 0.01f * i);
  SEED(0) SEED(1) SEED(2) SEED(3) SEED(4) SEED(5) SEED(6) SEED(7) SEED(8) SEED(9)
#undef SEED
  const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  {
    pybind11::gil_scoped_release no_gil;
    if (chains == 1) {
      for (int64_t i = 0; i < iters; ++i) a0 = _mm256_fmadd_ps(a0, b, c);
    } else {
      for (int64_t i = 0; i < iters; ++i) {
#define F(i) a##i = _mm256_fmadd_ps(a##i, b, c);
        F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9)
#undef F
      }
    }
  }
  const __m256 s = _mm256_add_ps(
      _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                    _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7))),
      _mm256_add_ps(a8, a9));
  return _mm256_cvtss_f32(s);
}

// MR rows over `panels` consecutive 16-column panels of K steps, as the GEMM's loop: inputs
// (K, MR) side by side; PREFETCH: the kernel's T0 prefetch 2 KiB ahead, one line per 2 k.
template <int MR, bool PREFETCH>
float panels_loop(const uint16_t* w, const float* x, int64_t K, int64_t panels) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 s = _mm256_setzero_ps();
  for (int64_t p = 0; p < panels; ++p) {
    const uint16_t* wp = w + p * K * 16;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < K; ++k) {
      const uint16_t* wk = wp + k * 16;
      if (PREFETCH && (k & 1) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(wk) + 2048, _MM_HINT_T0);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(wv, hi));
#define ROW(i)                                                 \
  if constexpr (MR > i) {                                      \
    const __m256 xv = _mm256_broadcast_ss(x + k * MR + i);     \
    c##i##0 = _mm256_fmadd_ps(w0, xv, c##i##0);                \
    c##i##1 = _mm256_fmadd_ps(w1, xv, c##i##1);                \
  }
      ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
    }
    const __m256 s01 = _mm256_add_ps(_mm256_add_ps(c00, c01), _mm256_add_ps(c10, c11));
    const __m256 s23 = _mm256_add_ps(_mm256_add_ps(c20, c21), _mm256_add_ps(c30, c31));
    const __m256 s45 = _mm256_add_ps(_mm256_add_ps(c40, c41), _mm256_add_ps(c50, c51));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(s01, s23), s45));
  }
  return _mm256_cvtss_f32(s);
}

// Seconds for `reps` passes of `rows` rows over `panels` panels of K steps (weights and inputs
// allocated and filled here, outside the timing).
double gemm_loop(int64_t rows, bool prefetch, int64_t K, int64_t panels, int64_t reps) {
  std::vector<uint16_t> w(panels * K * 16);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0x3f80 + (i % 7);
  std::vector<float> x(6 * K);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.001f * (1 + i % 13);
  pybind11::gil_scoped_release no_gil;
  const auto start = std::chrono::steady_clock::now();
  volatile float sink = 0;
  for (int64_t r = 0; r < reps; ++r) {
    if (rows == 4) sink = prefetch ? panels_loop<4, true>(w.data(), x.data(), K, panels)
                                   : panels_loop<4, false>(w.data(), x.data(), K, panels);
    else sink = prefetch ? panels_loop<6, true>(w.data(), x.data(), K, panels)
                         : panels_loop<6, false>(w.data(), x.data(), K, panels);
  }
  (void)sink;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
"""

FLOPS_PER_FMA = 16  # 8 lanes, multiply + add
PEAK_ITERS = 50_000_000
K = 1024
ROUNDS = 9


def build():
    build_dir = Path.home() / ".cache" / "pdserve" / "cpu_peak"
    build_dir.mkdir(parents=True, exist_ok=True)
    return load_inline(
        "pdserve_cpu_peak_v2", cpp_sources=SOURCE, functions=["fma_chains", "gemm_loop"],
        extra_cflags=["-O3", "-mavx2", "-mfma"], build_directory=str(build_dir),
    )  # fmt: skip


def fma_per_ns(module, chains: int, threads: int) -> float:
    """FMAs per nanosecond over all threads, each running `chains` chains."""
    args = (chains, PEAK_ITERS)
    workers = [threading.Thread(target=module.fma_chains, args=args) for _ in range(threads)]
    start = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return threads * chains * PEAK_ITERS / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    module = build()
    latency_ns = 1 / fma_per_ns(module, 1, 1)
    one = fma_per_ns(module, 10, 1)
    many = fma_per_ns(module, 10, args.threads)
    ghz = one / 2  # two FMA pipes per core (AVX2 x86 cores): cycles from the throughput
    print(f"FMA latency {latency_ns:.2f} ns ({latency_ns * ghz:.1f} cycles at {ghz:.2f} GHz)")
    print(f"FMA peak: 1 thread {one * FLOPS_PER_FMA:.1f} GFLOPS; {args.threads} threads "
          f"{many * FLOPS_PER_FMA:.1f} GFLOPS")  # fmt: skip
    variants = [  # (label, rows, prefetch, panels, reps): one 32 KB panel, or 64 MB streamed
        ("4 rows, one cached panel", 4, False, 1, 400),
        ("6 rows, one cached panel", 6, False, 1, 400),
        ("4 rows, streamed", 4, False, 2048, 1), ("4 rows, streamed + prefetch", 4, True, 2048, 1),
        ("6 rows, streamed", 6, False, 2048, 1), ("6 rows, streamed + prefetch", 6, True, 2048, 1),
    ]  # fmt: skip
    seconds: dict[str, list[float]] = {v[0]: [] for v in variants}
    for _ in range(ROUNDS):
        for label, rows, prefetch, panels, reps in variants:
            seconds[label].append(module.gemm_loop(rows, prefetch, K, panels, reps))
    print(f"GEMM inner loop, 1 thread, K = {K}, median of {ROUNDS} interleaved rounds:")
    for label, rows, _, panels, reps in variants:
        fmas = reps * panels * K * rows * 2
        rate = fmas / statistics.median(seconds[label]) / 1e9
        print(f"  {label:28}: {rate * FLOPS_PER_FMA:6.1f} GFLOPS ({rate / one:4.0%} of peak)")


if __name__ == "__main__":
    main()
