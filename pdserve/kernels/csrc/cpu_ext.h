// Shared helpers and entry points of the C++ CPU kernels (one Python module, bindings.cpp).
//
// Vectors are 8 float32 lanes (AVX2). Model tensors are bf16 or float32; bf16 values are
// widened to float32 in registers (a bf16 is the top half of a float32) and rounded back with
// round-to-nearest-even, like torch, so fused results match torch's per-op rounding.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace pdserve {

// ----- bf16 <-> float32 -------------------------------------------------------------------

inline __m256 bf16x8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Round-to-nearest-even float32 -> bfloat16 for 8 values (NaN not special-cased: inputs are
// finite).
inline __m128i to_bf16x8(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  b = _mm256_srli_epi32(b, 16);
  __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
  return _mm_packus_epi32(lo, hi);
}

// 8 values of a model tensor as float32, and back; overloaded on the element type so kernels
// are written once as templates over float / uint16_t (bf16 bits).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return bf16x8(p); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16x8(v));
}

// The value a float32 becomes when stored as T (round-to-nearest-even for bf16).
inline __m256 round_as(__m256 v, const float*) { return v; }
inline __m256 round_as(__m256 v, const uint16_t*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16x8(v)), 16));
}

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) {
  return static_cast<float>(c10::BFloat16(*p, c10::BFloat16::from_bits()));
}
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) { *p = c10::BFloat16(v).x; }

// ----- math ---------------------------------------------------------------------------------

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for 8 lanes: Cephes' expf (range reduction by ln 2, degree-5 polynomial), ~1 ulp.
// Inputs below -88.4 (including -inf) give 0, so masked scores need no special case.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-88.3762626647949f), hi = _mm256_set1_ps(88.3762626647949f);
  const __m256 is_tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
  return _mm256_andnot_ps(is_tiny, y);
}

// ----- entry points (bound in bindings.cpp) -------------------------------------------------

// dense_gemm.cpp: (N, K) bf16 or float32 -> packed panels; (M, K) rows times a packed weight.
at::Tensor pack(const at::Tensor& w);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                  const std::optional<at::Tensor>& bias, c10::ScalarType out_dtype);
// An uninitialised tensor in 2 MiB-aligned memory advised to use transparent huge pages.
at::Tensor empty_in_huge_pages(at::IntArrayRef sizes, const at::TensorOptions& options);

// quant_pack.cpp / quant_gemm.cpp: GGUF blocks (N, bytes_per_row) of a GGML type -> packed
// panels; float32 (M, K) rows times parts of packed weights stacked along N -> float32.
at::Tensor quant_pack(const at::Tensor& data, int64_t type, int64_t K);
at::Tensor quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& packed,
                        const std::vector<int64_t>& types, const std::vector<int64_t>& ns,
                        const std::optional<at::Tensor>& bias);
// Whether quant_linear runs its AVX-512 twins (same bits); the setter returns the previous
// value and stays off where the CPU lacks AVX-512.
bool avx512_enabled();
bool set_avx512(bool on);

// paged_attention.cpp: query rows (decode tokens or prompt chunks) against their sequences'
// pages of one layer's pool.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& layer_pool,
                           const at::Tensor& block_table,
                           const std::optional<at::Tensor>& seq_of_row,
                           const at::Tensor& context_lens, double scale, int64_t sliding_window,
                           const std::optional<at::Tensor>& new_kv);

// elementwise.cpp: rotary embedding of (T, heads, D) rows in place; SiLU(gate) * up.
void rope_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate_up);

// rmsnorm.cpp: RMSNorm of rows, and residual += x followed by RMSNorm of the new residual.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(const at::Tensor& residual, const at::Tensor& x,
                         const at::Tensor& weight, double eps);

// shm_gather.cpp: the tensor-parallel ranks' all-gather through a shared-memory region.
void shm_post(const at::Tensor& region, const at::Tensor& x, int64_t rank, int64_t size,
              int64_t seq, int64_t slot_bytes);
bool shm_wait_gather(const at::Tensor& region, const at::Tensor& out, int64_t size, int64_t seq,
                     int64_t slot_bytes, double wait_s);

// decoder_stack.cpp: a model's decoder layers in one call (the Python loop's kernels, in order).
struct Projection {  // a Linear as the kernels hold it: quantized parts, or dense panels
  std::vector<at::Tensor> packed;  // quant_pack()ed parts (empty: dense)
  std::vector<int64_t> types, ns;  // their GGML types and output columns
  at::Tensor dense;                // pack()ed panels when not quantized
  int64_t out_features = 0;
  std::optional<at::Tensor> bias;  // float32
  // A segmented row-parallel sum (parallel/row_parallel.py): bias-free pieces over input
  // columns [lo, hi) padded by (before, after) zeros, 4 bounds each; summed as a pairwise tree.
  std::vector<Projection> segments;
  std::vector<int64_t> bounds;
  at::Tensor operator()(const at::Tensor& x) const;
};
struct DecoderLayer {
  Projection qkv, o_proj, gate_up, down;
  at::Tensor input_norm, post_norm;  // float32
};
struct DecoderStack {
  std::vector<DecoderLayer> layers;
  std::vector<at::Tensor> pools;  // each layer's (num_pages, 2, page_size, Hkv, D) KV view
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0, sliding_window = 0;
  double scale = 1.0, eps = 1e-6;
  // h (T, hidden) += every layer's contributions, in place; x0 = RMSNorm(h) by layer 0's norm.
  // seq_of_row None: one decode row per sequence, lens = context lengths; else packed prompt
  // rows, lens = positions + 1 (see paged_attention).
  void forward_(const at::Tensor& h, const at::Tensor& x0, const at::Tensor& cos,
                const at::Tensor& sin, const at::Tensor& block_table,
                const std::optional<at::Tensor>& seq_of_row, const at::Tensor& lens) const;
};

// token_bitmask.cpp: -inf at every token of ``rows`` that its int32 bitmask row disallows.
void apply_token_bitmask_(const at::Tensor& logits, const std::vector<at::Tensor>& bitmasks,
                          const std::vector<int64_t>& rows, int64_t vocab_size);

}  // namespace pdserve
