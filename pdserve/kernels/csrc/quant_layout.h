// The packed layout of GGUF block-quantized weights (quant_pack.cpp writes it, quant_gemm.cpp
// reads it) and the one routine that dequantizes a packed block, for_each_k.
//
// A weight of N output columns is packed as panels of 16 columns (like bf16_gemm.cpp); each
// panel is a run of records, one per GGUF block along K (32 or 256 inputs), holding that block
// of all 16 columns. A record is the type's scales for the 16 columns followed by its quants
// as planes ordered by k, so unpacking walks memory strictly forward and lane i of a vector is
// column i (low half) or column 8 + i (high half):
// - 4-bit plane: 8 bytes per k; byte i holds column i in its low and column 8 + i in its high
//   nibble (one zero-extending load, a mask and a shift give both halves);
// - the fifth bit of Q5_0/Q5_1/Q5_K: a uint16 per k, bit c for column c; Q6_K's two high bits:
//   a uint32 per k, bits 2c..2c+1 (a variable shift moves each lane's bits into place);
// - Q8_0: 16 int8 per k; F16/BF16/F32: 16 values per k.
// Sizes equal the GGUF bytes except Q4_K/Q5_K (+2.8%/+2.3%: their 6-bit scales and mins are
// widened to bytes, so unpacking needs no bit shuffling).
//
// Numerics: every weight is dequantized by one formula, w = fma(q, s, b) with s and b the
// column's sub-block scale and offset (Q8_0: w = q * s), in float32. For every type here that
// equals gguf's reference dequantization bit for bit: the products d * sc, dmin * m and s * q are
// exact in float32 (at most 11 + 8 + 6 significant bits), so the fused result rounds once, as
// the reference does.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_ext.h"

namespace pdserve::quant {

constexpr int64_t kPanel = 16;  // output columns per panel

// GGML's type ids (gguf.GGMLQuantizationType).
enum Type : int64_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
                      Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };

struct Layout {
  int64_t block_k;       // inputs per GGUF block
  int64_t raw_bytes;     // bytes of one GGUF block (one column)
  int64_t record_bytes;  // bytes of one packed record (16 columns)
};

inline Layout layout_of(int64_t type) {
  switch (type) {
    case F32: return {32, 128, 32 * 16 * 4};
    case F16: case BF16: return {32, 64, 32 * 16 * 2};
    case Q8_0: return {32, 34, 32 + 32 * 16};
    case Q4_0: return {32, 18, 32 + 32 * 8};
    case Q4_1: return {32, 20, 64 + 32 * 8};
    case Q5_0: return {32, 22, 32 + 32 * 8 + 32 * 2};
    case Q5_1: return {32, 24, 64 + 32 * 8 + 32 * 2};
    case Q4_K: return {256, 144, 320 + 256 * 8};
    case Q5_K: return {256, 176, 320 + 256 * 8 + 256 * 2};
    case Q6_K: return {256, 210, 288 + 256 * 8 + 256 * 4};
    default: TORCH_CHECK(false, "quantized matmul: unsupported GGML type ", type);
  }
}

// Byte offsets inside a record.
constexpr int64_t kKQuantNibbles = 320;              // Q4_K/Q5_K: d, dmin, sc[8], m[8]
constexpr int64_t kQ5High = kKQuantNibbles + 2048;   // Q5_K: uint16 per k
constexpr int64_t kQ6Nibbles = 288;                  // Q6_K: d, sc[16]
constexpr int64_t kQ6High = kQ6Nibbles + 2048;       // Q6_K: uint32 per k

inline __m256 f16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m128i bytes8(const uint8_t* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}
inline __m256 u8x8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(p))); }
inline __m256 i8x8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(p))); }

// 16 columns' 4-bit quants at one k as two vectors of ints (columns 0-7, 8-15).
inline void nibbles16(const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i v = _mm256_cvtepu8_epi32(bytes8(p));
  lo = _mm256_and_si256(v, _mm256_set1_epi32(0x0F));
  hi = _mm256_srli_epi32(v, 4);
}

// Weights fma(q, s, b) of one k, handed to f(k, w0, w1) (columns 0-7, 8-15).
template <typename F>
inline void emit16(F& f, int64_t k, __m256i q0, __m256i q1, __m256 s0, __m256 s1, __m256 b0,
                   __m256 b1) {
  f(k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), s0, b0),
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), s1, b1));
}

// 4-bit quants of k0 .. k0 + count from `nib` (the record's plane) with one scale/offset pair.
template <typename F>
inline void emit_nibbles(F& f, const uint8_t* nib, int64_t k0, int64_t count, __m256 s0,
                         __m256 s1, __m256 b0, __m256 b1) {
  for (int64_t k = k0; k < k0 + count; ++k) {
    __m256i lo, hi;
    nibbles16(nib + k * 8, lo, hi);
    emit16(f, k, lo, hi, s0, s1, b0, b1);
  }
}

// Q4_K/Q5_K's sub-block j: s = d * sc_j, b = -(dmin * m_j).
inline void kquant_scales(const uint8_t* rec, int64_t j, __m256& s0, __m256& s1, __m256& b0,
                          __m256& b1) {
  const __m256 zero = _mm256_setzero_ps();
  s0 = _mm256_mul_ps(f16x8(rec), u8x8(rec + 64 + j * 16));
  s1 = _mm256_mul_ps(f16x8(rec + 16), u8x8(rec + 64 + j * 16 + 8));
  b0 = _mm256_sub_ps(zero, _mm256_mul_ps(f16x8(rec + 32), u8x8(rec + 192 + j * 16)));
  b1 = _mm256_sub_ps(zero, _mm256_mul_ps(f16x8(rec + 48), u8x8(rec + 192 + j * 16 + 8)));
}

// Each lane's high bits of a shared bit field: left by the lane's count, right by R, masked
// (the shift brings lower columns' bits along).
template <int R>
inline __m256i high_bits(__m256i h, __m256i up, __m256i mask) {
  return _mm256_and_si256(_mm256_srli_epi32(_mm256_sllv_epi32(h, up), R), mask);
}

// 4-bit quants plus a fifth bit per column (a uint16 per k, bit c for column c).
template <typename F>
inline void emit_5bit(F& f, const uint8_t* nib, const uint16_t* high, int64_t k0, int64_t count,
                      __m256 s0, __m256 s1, __m256 b0, __m256 b1) {
  const __m256i up0 = _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24);  // bit c -> 31
  const __m256i up1 = _mm256_setr_epi32(23, 22, 21, 20, 19, 18, 17, 16);
  const __m256i bit4 = _mm256_set1_epi32(0x10);
  for (int64_t k = k0; k < k0 + count; ++k) {
    __m256i lo, hi;
    nibbles16(nib + k * 8, lo, hi);
    const __m256i h = _mm256_set1_epi32(high[k]);
    lo = _mm256_or_si256(lo, high_bits<27>(h, up0, bit4));
    hi = _mm256_or_si256(hi, high_bits<27>(h, up1, bit4));
    emit16(f, k, lo, hi, s0, s1, b0, b1);
  }
}

// Calls f(k, w0, w1) for k = 0 .. block_k - 1 of one record, in order, with the 16 columns'
// float32 weights: the one place weights are dequantized (both matmul paths go through it).
template <int64_t T, typename F>
inline void for_each_k(const uint8_t* rec, F&& f) {
  if constexpr (T == F32) {
    const float* v = reinterpret_cast<const float*>(rec);
    for (int64_t k = 0; k < 32; ++k)
      f(k, _mm256_loadu_ps(v + k * 16), _mm256_loadu_ps(v + k * 16 + 8));
  } else if constexpr (T == F16) {
    for (int64_t k = 0; k < 32; ++k) f(k, f16x8(rec + k * 32), f16x8(rec + k * 32 + 16));
  } else if constexpr (T == BF16) {
    const uint16_t* v = reinterpret_cast<const uint16_t*>(rec);
    for (int64_t k = 0; k < 32; ++k) f(k, bf16x8(v + k * 16), bf16x8(v + k * 16 + 8));
  } else if constexpr (T == Q8_0) {
    const __m256 s0 = f16x8(rec), s1 = f16x8(rec + 16);
    for (int64_t k = 0; k < 32; ++k)
      f(k, _mm256_mul_ps(i8x8(rec + 32 + k * 16), s0), _mm256_mul_ps(i8x8(rec + 40 + k * 16), s1));
  } else if constexpr (T == Q4_0) {
    const __m256 s0 = f16x8(rec), s1 = f16x8(rec + 16), m8 = _mm256_set1_ps(-8.0f);
    emit_nibbles(f, rec + 32, 0, 32, s0, s1, _mm256_mul_ps(s0, m8), _mm256_mul_ps(s1, m8));
  } else if constexpr (T == Q4_1) {
    emit_nibbles(f, rec + 64, 0, 32, f16x8(rec), f16x8(rec + 16), f16x8(rec + 32),
                 f16x8(rec + 48));
  } else if constexpr (T == Q4_K) {
    for (int64_t j = 0; j < 8; ++j) {
      __m256 s0, s1, b0, b1;
      kquant_scales(rec, j, s0, s1, b0, b1);
      emit_nibbles(f, rec + kKQuantNibbles, j * 32, 32, s0, s1, b0, b1);
    }
  } else if constexpr (T == Q5_0) {
    const __m256 s0 = f16x8(rec), s1 = f16x8(rec + 16), m16 = _mm256_set1_ps(-16.0f);
    emit_5bit(f, rec + 32, reinterpret_cast<const uint16_t*>(rec + 32 + 256), 0, 32, s0, s1,
              _mm256_mul_ps(s0, m16), _mm256_mul_ps(s1, m16));
  } else if constexpr (T == Q5_1) {
    emit_5bit(f, rec + 64, reinterpret_cast<const uint16_t*>(rec + 64 + 256), 0, 32, f16x8(rec),
              f16x8(rec + 16), f16x8(rec + 32), f16x8(rec + 48));
  } else if constexpr (T == Q5_K) {
    const uint16_t* high = reinterpret_cast<const uint16_t*>(rec + kQ5High);
    for (int64_t j = 0; j < 8; ++j) {
      __m256 s0, s1, b0, b1;
      kquant_scales(rec, j, s0, s1, b0, b1);
      emit_5bit(f, rec + kKQuantNibbles, high, j * 32, 32, s0, s1, b0, b1);
    }
  } else if constexpr (T == Q6_K) {
    const __m256i up0 = _mm256_setr_epi32(30, 28, 26, 24, 22, 20, 18, 16);  // bits 2c -> 30
    const __m256i up1 = _mm256_setr_epi32(14, 12, 10, 8, 6, 4, 2, 0);
    const __m256i bits45 = _mm256_set1_epi32(0x30);
    const uint32_t* high = reinterpret_cast<const uint32_t*>(rec + kQ6High);
    const __m256 d0 = f16x8(rec), d1 = f16x8(rec + 16), m32 = _mm256_set1_ps(-32.0f);
    for (int64_t j = 0; j < 16; ++j) {  // sub-blocks of 16: w = (d * sc_j) * (q - 32)
      const __m256 s0 = _mm256_mul_ps(d0, i8x8(rec + 32 + j * 16));
      const __m256 s1 = _mm256_mul_ps(d1, i8x8(rec + 40 + j * 16));
      const __m256 b0 = _mm256_mul_ps(s0, m32), b1 = _mm256_mul_ps(s1, m32);
      for (int64_t k = j * 16; k < j * 16 + 16; ++k) {
        __m256i lo, hi;
        nibbles16(rec + kQ6Nibbles + k * 8, lo, hi);
        const __m256i h = _mm256_set1_epi32(static_cast<int>(high[k]));
        lo = _mm256_or_si256(lo, high_bits<26>(h, up0, bits45));
        hi = _mm256_or_si256(hi, high_bits<26>(h, up1, bits45));
        emit16(f, k, lo, hi, s0, s1, b0, b1);
      }
    }
  }
}

// One record -> out[block_k][16] float32 weights.
template <int64_t T>
inline void unpack_record(const uint8_t* rec, float* out) {
  for_each_k<T>(rec, [out](int64_t k, __m256 w0, __m256 w1) {
    _mm256_storeu_ps(out + k * kPanel, w0);
    _mm256_storeu_ps(out + k * kPanel + 8, w1);
  });
}

}  // namespace pdserve::quant
