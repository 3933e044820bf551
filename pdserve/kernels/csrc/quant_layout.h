// The packed layout of GGUF block-quantized weights (quant_pack.cpp writes it, quant_gemm.cpp
// reads it) and the one place each type's quants, scales and offsets are read (Dequant).
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
// Numerics: a weight is w = s * q + b, with s and b its column's sub-block scale and offset
// (b = 0 for Q8_0; the symmetric types' offsets, Q4_0's -8, Q5_0's -16 and Q6_K's -32, are
// taken off q as integers). The matmul (quant_gemm.cpp) keeps the scale and offset out of the
// inner loop: per sub-block it sums q * x, then scales the sum and adds b times the sum of x.
// Every q, s and b is exact in float32 (the products d * sc and dmin * m have at most 11 + 8
// significant bits), so a row that is a unit vector gives gguf's reference dequantization bit
// for bit: s * q needs at most 11 + 8 + 6 bits and the one addition of b rounds once, as the
// reference's does.
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

// Each lane's high bits of a shared bit field: left by the lane's count, right by R, masked
// (the shift brings lower columns' bits along).
template <int R>
inline __m256i high_bits(__m256i h, __m256i up, __m256i mask) {
  return _mm256_and_si256(_mm256_srli_epi32(_mm256_sllv_epi32(h, up), R), mask);
}

// The fifth bit of 16 columns' quants (a uint16, bit c for column c) into bit 4 of each lane.
inline void add_fifth_bit(uint16_t high, __m256i& lo, __m256i& hi) {
  const __m256i up0 = _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24);  // bit c -> 31
  const __m256i up1 = _mm256_setr_epi32(23, 22, 21, 20, 19, 18, 17, 16);
  const __m256i bit4 = _mm256_set1_epi32(0x10), h = _mm256_set1_epi32(high);
  lo = _mm256_or_si256(lo, high_bits<27>(h, up0, bit4));
  hi = _mm256_or_si256(hi, high_bits<27>(h, up1, bit4));
}

// Integer quants minus a constant (the symmetric types' offset; 0: none), as floats.
template <int kOffset>
inline void to_float(__m256i q0, __m256i q1, __m256& f0, __m256& f1) {
  if constexpr (kOffset != 0) {
    q0 = _mm256_sub_epi32(q0, _mm256_set1_epi32(kOffset));
    q1 = _mm256_sub_epi32(q1, _mm256_set1_epi32(kOffset));
  }
  f0 = _mm256_cvtepi32_ps(q0);
  f1 = _mm256_cvtepi32_ps(q1);
}

// 4-bit quants at k from the plane at rec + kNibbles, minus kOffset, as floats.
template <int64_t kNibbles, int kOffset>
inline void nibble_quants(const uint8_t* rec, int64_t k, __m256& f0, __m256& f1) {
  __m256i q0, q1;
  nibbles16(rec + kNibbles + k * 8, q0, q1);
  to_float<kOffset>(q0, q1, f0, f1);
}

// The same with each column's fifth bit from the uint16 plane at rec + kHigh.
template <int64_t kNibbles, int64_t kHigh, int kOffset>
inline void five_bit_quants(const uint8_t* rec, int64_t k, __m256& f0, __m256& f1) {
  __m256i q0, q1;
  nibbles16(rec + kNibbles + k * 8, q0, q1);
  add_fifth_bit(reinterpret_cast<const uint16_t*>(rec + kHigh)[k], q0, q1);
  to_float<kOffset>(q0, q1, f0, f1);
}

// Dequantizers: one per type, static reads of one record (columns 0-7 in the first vector,
// 8-15 in the second). kBlock: inputs per record; kSub: inputs sharing one scale and offset.
// kScaled false (F32/F16/BF16): quants() are the weights themselves. Otherwise quants(rec, k)
// gives k's quants as floats, scales(rec, j) sub-block j's s, and where kOffset, offsets(rec,
// j) its b (w = s * q + b; every offset type has kSub = 32).
template <int64_t T>
struct Dequant;

struct Unscaled {
  static constexpr int64_t kBlock = 32, kSub = 32;
  static constexpr bool kScaled = false, kOffset = false;
};
struct Scaled32 {  // one scale (and offset) per block of 32, f16 at rec and rec + 32
  static constexpr int64_t kBlock = 32, kSub = 32;
  static constexpr bool kScaled = true;
  static void scales(const uint8_t* rec, int64_t, __m256& s0, __m256& s1) {
    s0 = f16x8(rec), s1 = f16x8(rec + 16);
  }
  static void offsets(const uint8_t* rec, int64_t, __m256& b0, __m256& b1) {
    b0 = f16x8(rec + 32), b1 = f16x8(rec + 48);
  }
};
struct KQuant {  // Q4_K/Q5_K: sub-block j's s = d * sc_j, b = -(dmin * m_j)
  static constexpr int64_t kBlock = 256, kSub = 32;
  static constexpr bool kScaled = true, kOffset = true;
  static void scales(const uint8_t* rec, int64_t j, __m256& s0, __m256& s1) {
    s0 = _mm256_mul_ps(f16x8(rec), u8x8(rec + 64 + j * 16));
    s1 = _mm256_mul_ps(f16x8(rec + 16), u8x8(rec + 64 + j * 16 + 8));
  }
  static void offsets(const uint8_t* rec, int64_t j, __m256& b0, __m256& b1) {
    const __m256 zero = _mm256_setzero_ps();
    b0 = _mm256_sub_ps(zero, _mm256_mul_ps(f16x8(rec + 32), u8x8(rec + 192 + j * 16)));
    b1 = _mm256_sub_ps(zero, _mm256_mul_ps(f16x8(rec + 48), u8x8(rec + 192 + j * 16 + 8)));
  }
};

template <>
struct Dequant<F32> : Unscaled {
  static void quants(const uint8_t* rec, int64_t k, __m256& w0, __m256& w1) {
    const float* v = reinterpret_cast<const float*>(rec) + k * 16;
    w0 = _mm256_loadu_ps(v), w1 = _mm256_loadu_ps(v + 8);
  }
};
template <>
struct Dequant<F16> : Unscaled {
  static void quants(const uint8_t* rec, int64_t k, __m256& w0, __m256& w1) {
    w0 = f16x8(rec + k * 32), w1 = f16x8(rec + k * 32 + 16);
  }
};
template <>
struct Dequant<BF16> : Unscaled {
  static void quants(const uint8_t* rec, int64_t k, __m256& w0, __m256& w1) {
    const uint16_t* v = reinterpret_cast<const uint16_t*>(rec) + k * 16;
    w0 = bf16x8(v), w1 = bf16x8(v + 8);
  }
};
template <>
struct Dequant<Q8_0> : Scaled32 {
  static constexpr bool kOffset = false;
  static void quants(const uint8_t* rec, int64_t k, __m256& f0, __m256& f1) {
    f0 = i8x8(rec + 32 + k * 16), f1 = i8x8(rec + 40 + k * 16);
  }
};
template <>
struct Dequant<Q4_0> : Scaled32 {
  static constexpr bool kOffset = false;
  static constexpr auto quants = nibble_quants<32, 8>;
};
template <>
struct Dequant<Q4_1> : Scaled32 {
  static constexpr bool kOffset = true;
  static constexpr auto quants = nibble_quants<64, 0>;
};
template <>
struct Dequant<Q5_0> : Scaled32 {
  static constexpr bool kOffset = false;
  static constexpr auto quants = five_bit_quants<32, 32 + 256, 16>;
};
template <>
struct Dequant<Q5_1> : Scaled32 {
  static constexpr bool kOffset = true;
  static constexpr auto quants = five_bit_quants<64, 64 + 256, 0>;
};
template <>
struct Dequant<Q4_K> : KQuant {
  static constexpr auto quants = nibble_quants<kKQuantNibbles, 0>;
};
template <>
struct Dequant<Q5_K> : KQuant {
  static constexpr auto quants = five_bit_quants<kKQuantNibbles, kQ5High, 0>;
};
template <>
struct Dequant<Q6_K> {  // sub-blocks of 16: w = (d * sc_j) * (q - 32)
  static constexpr int64_t kBlock = 256, kSub = 16;
  static constexpr bool kScaled = true, kOffset = false;
  static void quants(const uint8_t* rec, int64_t k, __m256& f0, __m256& f1) {
    const __m256i up0 = _mm256_setr_epi32(30, 28, 26, 24, 22, 20, 18, 16);  // bits 2c -> 30
    const __m256i up1 = _mm256_setr_epi32(14, 12, 10, 8, 6, 4, 2, 0);
    const __m256i bits45 = _mm256_set1_epi32(0x30);
    const uint32_t high = reinterpret_cast<const uint32_t*>(rec + kQ6High)[k];
    const __m256i h = _mm256_set1_epi32(static_cast<int>(high));
    __m256i q0, q1;
    nibbles16(rec + kQ6Nibbles + k * 8, q0, q1);
    q0 = _mm256_or_si256(q0, high_bits<26>(h, up0, bits45));
    q1 = _mm256_or_si256(q1, high_bits<26>(h, up1, bits45));
    to_float<32>(q0, q1, f0, f1);
  }
  static void scales(const uint8_t* rec, int64_t j, __m256& s0, __m256& s1) {
    s0 = _mm256_mul_ps(f16x8(rec), i8x8(rec + 32 + j * 16));
    s1 = _mm256_mul_ps(f16x8(rec + 16), i8x8(rec + 40 + j * 16));
  }
};

}  // namespace pdserve::quant
