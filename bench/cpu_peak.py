"""What this CPU can do, against what the bf16 decode GEMM's inner loop gets.

    python bench/cpu_peak.py [--threads 2]

Builds a small C++ module (torch's cpp_extension, cached under ~/.cache/pdserve/cpu_peak) and
prints, in GFLOPS and cycles per k step (at the clock the peak implies):

* the float32 FMA peak: 12 independent AVX2 FMA chains per thread, registers only, on 1 and on
  ``--threads`` threads at once;
* the GEMM's inner loop (``csrc/bf16_gemm.cpp``: one 16-column bf16 panel widened by shift/and,
  each input value broadcast from memory) for 4 and 6 rows, on a cache-resident panel, with rows
  4 KiB apart (K = 1024, as in "small") and padded by 64 bytes, and with the inputs in registers.

The gap between the last two is what loading the inputs costs; the gap to the peak is what a
better micro-kernel could win (docs/benchmarks.md, session 4).
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <immintrin.h>
#include <torch/extension.h>

double fma_peak(int64_t iters) {
  __m256 a0 = _mm256_set1_ps(1.f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0,
         a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  {
    pybind11::gil_scoped_release no_gil;
    for (int64_t i = 0; i < iters; ++i) {
#define F(r) r = _mm256_fmadd_ps(r, b, c);
      F(a0) F(a1) F(a2) F(a3) F(a4) F(a5) F(a6) F(a7) F(a8) F(a9) F(a10) F(a11)
#undef F
    }
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                           _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
  s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
  return _mm256_cvtss_f32(s);
}

// MR rows x one 16-column panel, as the GEMM's loop; X_IN_REGS: inputs held in registers.
template <int MR, bool X_IN_REGS>
double panel_loop(const uint16_t* w, const float* x, int64_t ldx, int64_t K, int64_t reps) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256 r0 = _mm256_set1_ps(0.5f), r1 = _mm256_set1_ps(0.25f);
  for (int64_t r = 0; r < reps; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 16));
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(wv, hi));
#define ROW(i)                                                                   \
  if constexpr (MR > i) {                                                        \
    const __m256 xv = X_IN_REGS ? (i % 2 ? r1 : r0) : _mm256_broadcast_ss(x + i * ldx + k); \
    c##i##0 = _mm256_fmadd_ps(w0, xv, c##i##0);                                  \
    c##i##1 = _mm256_fmadd_ps(w1, xv, c##i##1);                                  \
  }
      ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
    }
  __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c00, c01), _mm256_add_ps(c10, c11)),
                           _mm256_add_ps(_mm256_add_ps(c20, c21), _mm256_add_ps(c30, c31)));
  s = _mm256_add_ps(s, _mm256_add_ps(c40, _mm256_add_ps(c41, _mm256_add_ps(c50, c51))));
  return _mm256_cvtss_f32(s);
}

double gemm_loop(int64_t rows, bool x_in_regs, int64_t ldx, int64_t K, int64_t reps) {
  std::vector<uint16_t> w(K * 16, 0x3f80);
  std::vector<float> x(6 * ldx, 0.001f);
  const auto* wp = w.data();
  const auto* xp = x.data();
  if (rows == 4) return x_in_regs ? panel_loop<4, true>(wp, xp, ldx, K, reps)
                                  : panel_loop<4, false>(wp, xp, ldx, K, reps);
  return x_in_regs ? panel_loop<6, true>(wp, xp, ldx, K, reps)
                   : panel_loop<6, false>(wp, xp, ldx, K, reps);
}
"""

FLOPS_PER_FMA = 16  # 8 lanes, multiply + add
PEAK_ITERS = 100_000_000
LOOP_K, LOOP_REPS = 256, 20_000


def build():
    build_dir = Path.home() / ".cache" / "pdserve" / "cpu_peak"
    build_dir.mkdir(parents=True, exist_ok=True)
    return load_inline(
        "pdserve_cpu_peak", cpp_sources=SOURCE, functions=["fma_peak", "gemm_loop"],
        extra_cflags=["-O3", "-mavx2", "-mfma"], build_directory=str(build_dir),
    )  # fmt: skip


def peak_gflops(module, threads: int) -> float:
    workers = [threading.Thread(target=module.fma_peak, args=(PEAK_ITERS,)) for _ in range(threads)]
    start = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return threads * PEAK_ITERS * 12 * FLOPS_PER_FMA / (time.perf_counter() - start) / 1e9


def loop_gflops(module, rows: int, x_in_regs: bool, ldx: int) -> float:
    module.gemm_loop(rows, x_in_regs, ldx, LOOP_K, 100)  # warm the caches
    start = time.perf_counter()
    module.gemm_loop(rows, x_in_regs, ldx, LOOP_K, LOOP_REPS)
    seconds = time.perf_counter() - start
    return LOOP_REPS * LOOP_K * rows * 2 * FLOPS_PER_FMA / seconds / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    module = build()
    one = peak_gflops(module, 1)
    print(f"FMA peak: 1 thread {one:.1f} GFLOPS; {args.threads} threads "
          f"{peak_gflops(module, args.threads):.1f} GFLOPS")  # fmt: skip
    fmas_per_cycle = 2  # AVX2 cores with two FMA pipes: the peak loop then implies the clock
    ghz = one / (fmas_per_cycle * FLOPS_PER_FMA)
    print(f"(clock implied at {fmas_per_cycle} FMAs/cycle: {ghz:.2f} GHz)")
    print("GEMM inner loop, 1 thread, cache-resident panel:")
    for rows in (4, 6):
        for label, x_in_regs, ldx in (("inputs 4 KiB apart", False, 1024),
                                      ("inputs padded 64 B", False, 1040),
                                      ("inputs in registers", True, 1040)):  # fmt: skip
            gflops = loop_gflops(module, rows, x_in_regs, ldx)
            cycles = rows * 2 * FLOPS_PER_FMA / gflops * ghz
            print(f"  {rows} rows, {label:20}: {gflops:6.1f} GFLOPS, {cycles:5.1f} cycles per k "
                  f"({gflops / one:4.0%} of one thread's peak)")  # fmt: skip


if __name__ == "__main__":
    main()
