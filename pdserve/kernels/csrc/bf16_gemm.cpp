// bf16-weight matrix products for few rows on AVX2 CPUs (decode steps).
//
// torch's bf16 matmul on CPUs without native bf16 instructions converts and re-reads weights
// per row; here each weight is read from memory once per call for all rows, converted to float32
// in registers, and accumulated in float32. Weights are packed once into panels of 16 output
// columns, (ceil(N/16), K, 16), so the inner loop reads memory strictly sequentially and
// broadcasts one input value per FMA pair. Within a panel row the 16 columns are interleaved
// (0, 8, 1, 9, ..., 7, 15): one 32-byte load holds column i in the low and column i + 8 in the
// high half of 32-bit lane i, so a shift and a mask widen both halves (no cross-lane shuffles).
// Threads split the panels (at::parallel_for, torch's own OpenMP pool). With more than one row
// the loop computes long enough per panel that the hardware prefetcher falls behind, and memory
// reads stop overlapping the FMAs; so the last row group of each panel prefetches the next panel
// into L2 (8 rows: 25 -> 19 ms per "small" step's projections; one row is a pure stream, where a
// second stream only slows it).
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_ext.h"

namespace pdserve {
namespace {

constexpr int64_t kPanel = 16;  // output columns per packed panel (two AVX2 vectors)

template <typename Out>
inline void store16(Out* y, __m256 a, __m256 b, int64_t n) {
  alignas(32) float tmp[kPanel];
  _mm256_store_ps(tmp, a);
  _mm256_store_ps(tmp + 8, b);
  if constexpr (std::is_same_v<Out, float>) {
    if (n == kPanel) { _mm256_storeu_ps(y, a); _mm256_storeu_ps(y + 8, b); return; }
    std::memcpy(y, tmp, n * sizeof(float));
  } else {
    alignas(16) uint16_t h[kPanel];
    _mm_store_si128(reinterpret_cast<__m128i*>(h), to_bf16x8(a));
    _mm_store_si128(reinterpret_cast<__m128i*>(h + 8), to_bf16x8(b));
    std::memcpy(y, h, n * sizeof(uint16_t));
  }
}

// Adds the (padded, 16-wide) bias if any and stores the first n of 16 outputs.
template <typename Out>
inline void finish(__m256 lo, __m256 hi, const float* bias16, Out* y, int64_t n) {
  if (bias16 != nullptr) {
    lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias16));
    hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias16 + 8));
  }
  store16(y, lo, hi, n);
}

// MR (1..6) rows times one packed panel: each converted weight vector feeds MR FMAs. Every row
// sums over k in the same order whatever MR is, so a row's result never depends on its batch.
// `prefetch`: the next panel (K * 32 bytes, one 64-byte line per k over the first half), or null.
// Accumulators are named variables, not an array: GCC spills arrays of vectors to the stack.
template <int MR, typename Out>
inline void panel_rows(const float* x, int64_t ldx, const uint16_t* w, int64_t K,
                       const float* bias16, Out* y, int64_t ldy, int64_t n,
                       const char* prefetch) {
  static_assert(MR >= 1 && MR <= 6);
  const __m256 z = _mm256_setzero_ps();
  const __m256i high_halves = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z;
  __m256 c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch != nullptr && k < K / 2) _mm_prefetch(prefetch + k * 64, _MM_HINT_T1);
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * kPanel));
    const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
    const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(wv, high_halves));
#define PD_ROW(i)                                                 \
    if constexpr (MR > i) {                                       \
      const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);     \
      c##i##0 = _mm256_fmadd_ps(w0, xv, c##i##0);                 \
      c##i##1 = _mm256_fmadd_ps(w1, xv, c##i##1);                 \
    }
    PD_ROW(0) PD_ROW(1) PD_ROW(2) PD_ROW(3) PD_ROW(4) PD_ROW(5)
#undef PD_ROW
  }
#define PD_FINISH(i) \
  if constexpr (MR > i) finish(c##i##0, c##i##1, bias16, y + i * ldy, n);
  PD_FINISH(0) PD_FINISH(1) PD_FINISH(2) PD_FINISH(3) PD_FINISH(4) PD_FINISH(5)
#undef PD_FINISH
}

// Panel p's 16 bias values (zero-padded) in `bias16`; nullptr without a bias.
inline const float* panel_bias(const float* bias, int64_t N, int64_t p, float* bias16) {
  if (bias == nullptr) return nullptr;
  const int64_t col = p * kPanel, n = std::min(kPanel, N - col);
  std::memset(bias16, 0, kPanel * sizeof(float));
  std::memcpy(bias16, bias + col, n * sizeof(float));
  return bias16;
}

template <typename Out>
void run(const float* x, int64_t M, int64_t K, const uint16_t* wp, int64_t N, const float* bias,
         Out* y) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* w = wp + p * K * kPanel;
      const int64_t col = p * kPanel, n = std::min(kPanel, N - col);
      alignas(32) float bias16[kPanel];
      const float* b = panel_bias(bias, N, p, bias16);
      // Balanced row groups of at most 6 (8 rows -> 4 + 4, not 6 + 2): small groups are
      // FMA-latency bound, so no group should be much smaller than the others.
      const int64_t groups = (M + 5) / 6;
      for (int64_t g = 0, m = 0; g < groups; ++g) {
        const int64_t rows = (M - m + (groups - g) - 1) / (groups - g);
        const float* xm = x + m * K;
        Out* ym = y + m * N + col;
        const bool prefetches = M > 1 && g == groups - 1 && p + 1 < p1;
        const char* pf = prefetches ? reinterpret_cast<const char*>(w + K * kPanel) : nullptr;
        switch (rows) {
          case 6: panel_rows<6, Out>(xm, K, w, K, b, ym, N, n, pf); break;
          case 5: panel_rows<5, Out>(xm, K, w, K, b, ym, N, n, pf); break;
          case 4: panel_rows<4, Out>(xm, K, w, K, b, ym, N, n, pf); break;
          case 3: panel_rows<3, Out>(xm, K, w, K, b, ym, N, n, pf); break;
          case 2: panel_rows<2, Out>(xm, K, w, K, b, ym, N, n, pf); break;
          default: panel_rows<1, Out>(xm, K, w, K, b, ym, N, n, pf); break;
        }
        m += rows;
      }
    }
  });
}

// The rows as contiguous float32: a pointer into x when it already is, else a copy in `buf`.
// A decode step's rows are a few KB, so converting here costs less than dispatching torch's
// conversion operator (about 15 us per projection on the 2-core test machine).
const float* float_rows(const at::Tensor& x, std::vector<float>& buf) {
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kFloat && x.is_contiguous()) return x.data_ptr<float>();
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "linear: float32 or bf16 rows");
  buf.resize(M * K);
  for (int64_t m = 0; m < M; ++m) {
    float* dst = buf.data() + m * K;
    if (x.scalar_type() == at::kFloat) {
      const float* src = x.data_ptr<float>() + m * x.stride(0);
      for (int64_t k = 0; k < K; ++k) dst[k] = src[k * x.stride(1)];
      continue;
    }
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr()) + m * x.stride(0);
    int64_t k = 0;
    if (x.stride(1) == 1)
      for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, bf16x8(src + k));
    for (; k < K; ++k) dst[k] = load1(src + k * x.stride(1));
  }
  return buf.data();
}

}  // namespace

// (N, K) bf16 -> (ceil(N/16), K, 16) bf16, zero-padded columns, each row of 16 interleaved as
// (0, 8, 1, 9, ..., 7, 15).
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.dtype() == at::kBFloat16);
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = at::zeros({panels * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  // (panel, half, i, k) -> (panel, k, i, half): slot 2i + half holds column 8 * half + i.
  return padded.view({panels, 2, kPanel / 2, K}).permute({0, 3, 2, 1}).contiguous().view(
      {panels, K, kPanel});
}

// x (M, K) float32 or bf16; packed from pack(); bias float32 (N) or None -> (M, N) of out_dtype.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                  const std::optional<at::Tensor>& bias, c10::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && packed.dtype() == at::kBFloat16 && packed.is_contiguous());
  std::vector<float> buf;
  const float* xf = float_rows(x, buf);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(1) == K && packed.size(0) * kPanel >= N);
  const float* bp = nullptr;
  at::Tensor bf;
  if (bias.has_value()) { bf = bias->to(at::kFloat).contiguous(); bp = bf.data_ptr<float>(); }
  auto y = at::empty({M, N}, x.options().dtype(out_dtype));
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  if (out_dtype == at::kFloat) {
    run<float>(xf, M, K, wp, N, bp, y.data_ptr<float>());
  } else {
    TORCH_CHECK(out_dtype == at::kBFloat16);
    run<uint16_t>(xf, M, K, wp, N, bp,
                  reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  }
  return y;
}

}  // namespace pdserve
