// The AVX-512 twins of quant_gemm.cpp's kernels, for CPUs that have it: one 16-lane vector
// per panel where the AVX2 code holds two 8-lane halves. Lane c is column c and every output
// element gets exactly the fma sequence of the AVX2 path (header comment of quant_gemm.cpp), so
// results are bit for bit equal: a worker's tokens do not depend on which of the two its CPU
// runs. Each function carries its own target attribute; the rest of the module stays AVX2.
#pragma once

#include <cstring>

#include "quant_panels.h"

namespace pdserve::quant {

#define PD_AVX512 __attribute__((target("avx512f")))

// Decode: 16 quants (or weights) of one k of a packed record as one vector, and a sub-block's
// 16 scales and offsets, computed as Dequant<T> computes them (the same products, so the same
// floats).
PD_AVX512 inline __m512 f16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
PD_AVX512 inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
PD_AVX512 inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The 4-bit plane's 8 bytes at p (byte i: column i low, column 8 + i high) as 16 lanes of ints.
PD_AVX512 inline __m512i nibbles16x(const uint8_t* p) {
  int64_t bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  const __m512i v = _mm512_cvtepu8_epi32(_mm_set1_epi64x(bytes));  // the 8 bytes, twice
  const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
  return _mm512_and_si512(_mm512_srlv_epi32(v, shift), _mm512_set1_epi32(0x0F));
}

template <int kOffset>
PD_AVX512 inline __m512 to_float16(__m512i q) {
  if constexpr (kOffset != 0) q = _mm512_sub_epi32(q, _mm512_set1_epi32(kOffset));
  return _mm512_cvtepi32_ps(q);
}

template <int64_t T>
struct Wide;
struct WideScaled32 {  // f16 scales at rec, offsets at rec + 32 (as Scaled32)
  PD_AVX512 static __m512 scales(const uint8_t* rec, int64_t) { return f16x16(rec); }
  PD_AVX512 static __m512 offsets(const uint8_t* rec, int64_t) { return f16x16(rec + 32); }
};
struct WideKQuant {  // Q4_K/Q5_K: s = d * sc_j, b = -(dmin * m_j) (as KQuant)
  PD_AVX512 static __m512 scales(const uint8_t* rec, int64_t j) {
    return _mm512_mul_ps(f16x16(rec), u8x16(rec + 64 + j * 16));
  }
  PD_AVX512 static __m512 offsets(const uint8_t* rec, int64_t j) {
    const __m512 dm = _mm512_mul_ps(f16x16(rec + 32), u8x16(rec + 192 + j * 16));
    return _mm512_sub_ps(_mm512_setzero_ps(), dm);
  }
};
template <int64_t kNibbles, int kOffset>
struct WideNibbles {
  PD_AVX512 static __m512 quants(const uint8_t* rec, int64_t k) {
    return to_float16<kOffset>(nibbles16x(rec + kNibbles + k * 8));
  }
};
template <int64_t kNibbles, int64_t kHigh, int kOffset>
struct WideFiveBit {  // the fifth bit: a uint16 per k, bit c for column c = lane c's mask bit
  PD_AVX512 static __m512 quants(const uint8_t* rec, int64_t k) {
    uint16_t high;
    std::memcpy(&high, rec + kHigh + k * 2, sizeof high);
    const __m512i q = nibbles16x(rec + kNibbles + k * 8);
    return to_float16<kOffset>(_mm512_mask_or_epi32(q, high, q, _mm512_set1_epi32(0x10)));
  }
};

template <>
struct Wide<Q8_0> : WideScaled32 {
  PD_AVX512 static __m512 quants(const uint8_t* rec, int64_t k) { return i8x16(rec + 32 + k * 16); }
};
template <>
struct Wide<Q4_0> : WideScaled32, WideNibbles<32, 8> {};
template <>
struct Wide<Q4_1> : WideScaled32, WideNibbles<64, 0> {};
template <>
struct Wide<Q5_0> : WideScaled32, WideFiveBit<32, 32 + 256, 16> {};
template <>
struct Wide<Q5_1> : WideScaled32, WideFiveBit<64, 64 + 256, 0> {};
template <>
struct Wide<Q4_K> : WideKQuant, WideNibbles<kKQuantNibbles, 0> {};
template <>
struct Wide<Q5_K> : WideKQuant, WideFiveBit<kKQuantNibbles, kQ5High, 0> {};
template <>
struct Wide<Q6_K> {  // two high bits per column from a uint32 per k (bits 2c, 2c + 1)
  PD_AVX512 static __m512 quants(const uint8_t* rec, int64_t k) {
    uint32_t high;
    std::memcpy(&high, rec + kQ6High + k * 4, sizeof high);
    const __m512i shift = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i h = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(high)), shift), _mm512_set1_epi32(3));
    const __m512i q = _mm512_or_si512(nibbles16x(rec + kQ6Nibbles + k * 8), _mm512_slli_epi32(h, 4));
    return to_float16<32>(q);
  }
  PD_AVX512 static __m512 scales(const uint8_t* rec, int64_t j) {
    return _mm512_mul_ps(f16x16(rec), i8x16(rec + 32 + j * 16));
  }
};
template <>
struct Wide<F16> {
  PD_AVX512 static __m512 quants(const uint8_t* rec, int64_t k) { return f16x16(rec + k * 32); }
};
template <>
struct Wide<BF16> {
  PD_AVX512 static __m512 quants(const uint8_t* rec, int64_t k) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + k * 32));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};
template <>
struct Wide<F32> {
  PD_AVX512 static __m512 quants(const uint8_t* rec, int64_t k) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(rec) + k * 16);
  }
};

// The two ways through a panel, 16 lanes at a time: its packed records converted as they are
// read (decode), or the panel converted once by unpack() (prefill).
template <int64_t T>
struct WidePacked {
  PackedPanel<T> panel;
  void begin_sub(int64_t k0) { panel.begin_sub(k0); }
  PD_AVX512 __m512 quants(int64_t k) const { return Wide<T>::quants(panel.rec, k - panel.k_base); }
  PD_AVX512 __m512 scales() const { return Wide<T>::scales(panel.rec, panel.j); }
  PD_AVX512 __m512 offsets() const { return Wide<T>::offsets(panel.rec, panel.j); }
};
struct WideUnpacked {
  UnpackedPanel panel;
  void begin_sub(int64_t k0) { panel.begin_sub(k0); }
  PD_AVX512 __m512 quants(int64_t k) const { return _mm512_loadu_ps(panel.q + k * kPanel); }
  PD_AVX512 __m512 scales() const { return _mm512_loadu_ps(panel.s + panel.j * kPanel); }
  PD_AVX512 __m512 offsets() const { return _mm512_loadu_ps(panel.b + panel.j * kPanel); }
};

// MR rows times NP panels read through src[0..NP): quant_gemm.cpp's rows_times_panels with one
// 16-lane vector per panel and row.
template <int64_t T, int MR, int NP, typename Src>
PD_AVX512 void rows_times_panels_avx512(const float* x, const float* xs, int64_t K,
                                        const Src* panels, const PanelCols* cols, float* y,
                                        int64_t ldy) {
  using D = Dequant<T>;
  Src src[NP];  // local copies: their cursors stay in registers
  __m512 acc[NP][MR];
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) {
    src[p] = panels[p];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[p][i] = _mm512_setzero_ps();
  }
  for (int64_t k0 = 0; k0 < K; k0 += D::kSub) {
    __m512 blk[NP][MR];  // the sub-block's sums (the float types: the whole sums)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      src[p].begin_sub(k0);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) blk[p][i] = D::kScaled ? _mm512_setzero_ps() : acc[p][i];
    }
    for (int64_t k = k0; k < k0 + D::kSub; ++k) {
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        const __m512 q = src[p].quants(k);
        // Broadcast at each use (an fma with a memory operand), not held: 6 rows x 2 panels of
        // sums and accumulators already take 24 of the 32 vector registers.
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i)
          blk[p][i] = _mm512_fmadd_ps(q, _mm512_set1_ps(x[k * MR + i]), blk[p][i]);
      }
    }
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      if constexpr (!D::kScaled) {
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) acc[p][i] = blk[p][i];
      } else {
        const __m512 s = src[p].scales();
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) acc[p][i] = _mm512_fmadd_ps(blk[p][i], s, acc[p][i]);
        if constexpr (D::kOffset) {
          const __m512 b = src[p].offsets();
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            const __m512 xsv = _mm512_set1_ps(xs[(k0 / kOffsetSub) * MR + i]);
            acc[p][i] = _mm512_fmadd_ps(xsv, b, acc[p][i]);
          }
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) {
    const __m512 bias = _mm512_loadu_ps(cols[p].bias16);
    const __mmask16 columns = static_cast<__mmask16>((1u << cols[p].n) - 1);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
      _mm512_mask_storeu_ps(y + i * ldy + cols[p].col, columns, _mm512_add_ps(acc[p][i], bias));
  }
}

#undef PD_AVX512

}  // namespace pdserve::quant
