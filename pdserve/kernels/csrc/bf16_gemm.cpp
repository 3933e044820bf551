// bf16-weight matrix products for few rows on AVX2 CPUs (decode steps).
//
// torch's bf16 matmul on CPUs without native bf16 instructions converts and re-reads weights
// per row; here each weight is read from memory once per call for all rows, converted to float32
// in registers, and accumulated in float32. Weights are packed once into panels of 16 output
// columns, (ceil(N/16), K, 16), so the inner loop reads memory strictly sequentially and
// broadcasts one input value per FMA pair. Threads split the panels (at::parallel_for, torch's
// own OpenMP pool).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>
#include <optional>
#include <type_traits>

namespace {

constexpr int64_t kPanel = 16;  // output columns per packed panel (two AVX2 vectors)

inline __m256 bf16x8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Round-to-nearest-even float32 -> bfloat16 for 8 values (NaN not special-cased: inputs are finite).
inline __m128i to_bf16x8(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  b = _mm256_srli_epi32(b, 16);
  __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
  return _mm_packus_epi32(lo, hi);
}

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
// Accumulators are named variables, not an array: GCC spills arrays of vectors to the stack.
template <int MR, typename Out>
inline void panel_rows(const float* x, int64_t ldx, const uint16_t* w, int64_t K,
                       const float* bias16, Out* y, int64_t ldy, int64_t n) {
  static_assert(MR >= 1 && MR <= 6);
  const __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z;
  __m256 c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = bf16x8(w + k * kPanel), w1 = bf16x8(w + k * kPanel + 8);
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

template <typename Out>
void run(const float* x, int64_t M, int64_t K, const uint16_t* wp, int64_t N, const float* bias,
         Out* y) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* w = wp + p * K * kPanel;
      const int64_t col = p * kPanel, n = std::min(kPanel, N - col);
      alignas(32) float bias16[kPanel] = {0};
      if (bias != nullptr) std::memcpy(bias16, bias + col, n * sizeof(float));
      const float* b = bias != nullptr ? bias16 : nullptr;
      // Balanced row groups of at most 6 (8 rows -> 4 + 4, not 6 + 2): small groups are
      // FMA-latency bound, so no group should be much smaller than the others.
      const int64_t groups = (M + 5) / 6;
      for (int64_t g = 0, m = 0; g < groups; ++g) {
        const int64_t rows = (M - m + (groups - g) - 1) / (groups - g);
        const float* xm = x + m * K;
        Out* ym = y + m * N + col;
        switch (rows) {
          case 6: panel_rows<6, Out>(xm, K, w, K, b, ym, N, n); break;
          case 5: panel_rows<5, Out>(xm, K, w, K, b, ym, N, n); break;
          case 4: panel_rows<4, Out>(xm, K, w, K, b, ym, N, n); break;
          case 3: panel_rows<3, Out>(xm, K, w, K, b, ym, N, n); break;
          case 2: panel_rows<2, Out>(xm, K, w, K, b, ym, N, n); break;
          default: panel_rows<1, Out>(xm, K, w, K, b, ym, N, n); break;
        }
        m += rows;
      }
    }
  });
}

}  // namespace

// (N, K) bf16 -> (ceil(N/16), K, 16) bf16, zero-padded columns.
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.dtype() == torch::kBFloat16);
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

// x (M, K) float32 or bf16; packed from pack(); bias float32 (N) or None -> (M, N) of out_dtype.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N,
                     std::optional<torch::Tensor> bias, c10::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && packed.dtype() == torch::kBFloat16 && packed.is_contiguous());
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  TORCH_CHECK(packed.size(1) == K && packed.size(0) * kPanel >= N);
  const float* bp = nullptr;
  torch::Tensor bf;
  if (bias.has_value()) { bf = bias->to(torch::kFloat32).contiguous(); bp = bf.data_ptr<float>(); }
  auto y = torch::empty({M, N}, xf.options().dtype(out_dtype));
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  if (out_dtype == torch::kFloat32) {
    run<float>(xf.data_ptr<float>(), M, K, wp, N, bp, y.data_ptr<float>());
  } else {
    TORCH_CHECK(out_dtype == torch::kBFloat16);
    run<uint16_t>(xf.data_ptr<float>(), M, K, wp, N, bp,
                  reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack);
  m.def("linear", &linear);
}
