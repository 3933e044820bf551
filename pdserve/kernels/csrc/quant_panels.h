// Reading a packed weight panel by panel (quant_gemm.cpp and its AVX-512 twin,
// quant_avx512.h): a cursor over a panel's packed records, converted in registers as they are
// read (decode), or the panel converted once into float32 (prefill); and the output columns a
// panel fills.
#pragma once

#include <algorithm>
#include <cstring>

#include "quant_layout.h"

namespace pdserve::quant {

constexpr int64_t kOffsetSub = 32;  // the sub-block of every type with offsets

inline void prefetch_record(const uint8_t* rec, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(rec) + off, _MM_HINT_T0);
}

// A panel as its packed records, converted in registers as they are read.
template <int64_t T>
struct PackedPanel {
  using D = Dequant<T>;
  const uint8_t* panel;
  int64_t record_bytes;
  const uint8_t* rec = nullptr;
  int64_t k_base = 0, j = 0;

  void begin_sub(int64_t k0) {
    const int64_t block = k0 / D::kBlock;
    rec = panel + block * record_bytes;
    k_base = block * D::kBlock;
    j = (k0 - k_base) / D::kSub;
    if (j == 0) prefetch_record(rec + record_bytes, record_bytes);  // the next record
  }
  void quants(int64_t k, __m256& q0, __m256& q1) const { D::quants(rec, k - k_base, q0, q1); }
  void scales(__m256& s0, __m256& s1) const {
    if constexpr (D::kScaled) D::scales(rec, j, s0, s1);
  }
  void offsets(__m256& b0, __m256& b1) const {
    if constexpr (D::kOffset) D::offsets(rec, j, b0, b1);
  }
};

// A panel converted once (unpack): quants (K, 16), scales and offsets (K / kSub, 16).
struct UnpackedPanel {
  const float *q, *s, *b;
  int64_t sub, j = 0;

  void begin_sub(int64_t k0) { j = k0 / sub; }
  void quants(int64_t k, __m256& q0, __m256& q1) const {
    q0 = _mm256_loadu_ps(q + k * kPanel), q1 = _mm256_loadu_ps(q + k * kPanel + 8);
  }
  void scales(__m256& s0, __m256& s1) const {
    s0 = _mm256_loadu_ps(s + j * kPanel), s1 = _mm256_loadu_ps(s + j * kPanel + 8);
  }
  void offsets(__m256& b0, __m256& b1) const {
    b0 = _mm256_loadu_ps(b + j * kPanel), b1 = _mm256_loadu_ps(b + j * kPanel + 8);
  }
};

template <int64_t T>
void unpack(const uint8_t* panel, int64_t K, int64_t record_bytes, float* q, float* s, float* b) {
  using D = Dequant<T>;
  PackedPanel<T> src{panel, record_bytes};
  for (int64_t k0 = 0; k0 < K; k0 += D::kSub) {
    src.begin_sub(k0);
    for (int64_t k = k0; k < k0 + D::kSub; ++k) {
      __m256 q0, q1;
      src.quants(k, q0, q1);
      _mm256_storeu_ps(q + k * kPanel, q0);
      _mm256_storeu_ps(q + k * kPanel + 8, q1);
    }
    __m256 v0 = _mm256_setzero_ps(), v1 = v0, o0 = v0, o1 = v0;
    src.scales(v0, v1);
    src.offsets(o0, o1);
    const int64_t j = k0 / D::kSub;
    _mm256_storeu_ps(s + j * kPanel, v0), _mm256_storeu_ps(s + j * kPanel + 8, v1);
    _mm256_storeu_ps(b + j * kPanel, o0), _mm256_storeu_ps(b + j * kPanel + 8, o1);
  }
}

// One part of a fused weight: its packed panels, type and output columns [col0, col0 + N).
struct Part {
  const uint8_t* packed;
  int64_t type, N, col0;
  Layout lay;
};

// Panel p's column range and its 16 bias values (zero-padded).
struct PanelCols {
  int64_t col = 0, n = 0;
  alignas(32) float bias16[kPanel] = {};

  void set(const Part& part, int64_t p, const float* bias) {
    col = part.col0 + p * kPanel;
    n = std::min(kPanel, part.N - p * kPanel);
    if (bias != nullptr) std::memcpy(bias16, bias + col, n * sizeof(float));
  }
};

}  // namespace pdserve::quant
