// Grammar masks applied to float32 logits in place: every token a row's bitmask does not allow
// becomes -inf. One call for all of a step's constrained rows instead of a chain of torch ops
// (unpack, lookup, add); a row's work is a few thousand byte tests, so it runs on the calling
// thread (the runner's, GIL released) and never wakes the forward's OpenMP threads.
#include "cpu_ext.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace pdserve {
namespace {

// Bit ``v % 32`` of int32 word ``v // 32`` allows token ``v`` (llguidance's and xgrammar's
// layout). Words are little-endian, so byte ``k`` of the row holds tokens 8k ... 8k + 7.
void mask_row(float* logits, int64_t width, const uint8_t* bytes, int64_t num_bytes,
              int64_t vocab_size) {
  const int64_t allowed_end = std::min({width, vocab_size, num_bytes * 8});
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t v = 0;
  for (; v + 8 <= allowed_end; v += 8) {
    const uint8_t b = bytes[v / 8];
    if (b == 0xFF) continue;  // all eight allowed: the common case inside free text
    const __m256i bits = _mm256_and_si256(_mm256_set1_epi32(b), lane_bits);
    const __m256i disallowed = _mm256_cmpeq_epi32(bits, _mm256_setzero_si256());
    const __m256 kept = _mm256_loadu_ps(logits + v);
    _mm256_storeu_ps(logits + v, _mm256_blendv_ps(kept, neg_inf, _mm256_castsi256_ps(disallowed)));
  }
  for (; v < allowed_end; ++v) {
    if (!((bytes[v / 8] >> (v % 8)) & 1)) logits[v] = -std::numeric_limits<float>::infinity();
  }
  // Past the mask, or past the tokenizer's vocabulary (a model's padded rows): never allowed.
  for (; v < width; ++v) logits[v] = -std::numeric_limits<float>::infinity();
}

}  // namespace

void apply_token_bitmask_(const at::Tensor& logits, const std::vector<at::Tensor>& bitmasks,
                          const std::vector<int64_t>& rows, int64_t vocab_size) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be a (B, V) float32 CPU tensor with contiguous rows");
  TORCH_CHECK(bitmasks.size() == rows.size(), "one bitmask per row");
  const int64_t width = logits.size(1);
  for (size_t i = 0; i < rows.size(); ++i) {
    const at::Tensor& mask = bitmasks[i];
    TORCH_CHECK(mask.device().is_cpu() && mask.scalar_type() == at::kInt && mask.dim() == 1 &&
                    mask.is_contiguous(),
                "a bitmask must be a contiguous 1-D int32 CPU tensor");
    TORCH_CHECK(rows[i] >= 0 && rows[i] < logits.size(0), "row ", rows[i], " out of range");
    mask_row(logits.data_ptr<float>() + rows[i] * logits.stride(0), width,
             reinterpret_cast<const uint8_t*>(mask.data_ptr<int32_t>()), mask.numel() * 4,
             vocab_size);
  }
}

}  // namespace pdserve
