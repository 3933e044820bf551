// Per-token elementwise steps of a decoder layer, each one pass instead of a chain of torch ops:
// rotary embeddings in place, and SiLU(gate) * up of the fused gate/up projection.
#include "cpu_ext.h"

namespace pdserve {
namespace {

// Fewer elements than this run on the calling thread (a decode step's few rows).
constexpr int64_t kMinParallelElems = 1 << 15;

int64_t grain(int64_t num_rows, int64_t row_elems) {
  return num_rows * row_elems < kMinParallelElems
             ? std::max<int64_t>(num_rows, 1)
             : std::max<int64_t>(1, kMinParallelElems / std::max<int64_t>(row_elems, 1));
}

// x[t, h] = x * cos[t] + roll(x, D/2) * signed_sin[t] for every (token, head) row; both halves
// are read before either is written, so the rotation is in place.
template <typename T>
void rope_rows(T* x, int64_t T_, int64_t H, int64_t sx0, int64_t sx1, const T* cos,
               const T* sin, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, T_ * H, grain(T_ * H, D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = r / H;
      T* row = x + t * sx0 + (r % H) * sx1;
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t i = 0; i < half; i += 8) {
        const __m256 a = load8(row + i), b = load8(row + half + i);
        const __m256 lo = _mm256_fmadd_ps(b, load8(s + i), _mm256_mul_ps(a, load8(c + i)));
        const __m256 hi =
            _mm256_fmadd_ps(a, load8(s + half + i), _mm256_mul_ps(b, load8(c + half + i)));
        store8(row + i, lo);
        store8(row + half + i, hi);
      }
    }
  });
}

// y[t] = silu(gu[t, :n]) * gu[t, n:], silu(g) = g / (1 + exp(-g)).
template <typename T>
void silu_mul_rows(const T* gu, int64_t rows, int64_t stride, int64_t n, T* y) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  at::parallel_for(0, rows, grain(rows, n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * stride;
      const T* u = g + n;
      T* out = y + r * n;
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m256 gv = load8(g + i);
        const __m256 e = exp8(_mm256_xor_ps(gv, sign));
        store8(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), load8(u + i)));
      }
      for (; i < n; ++i) {
        const float gv = load1(g + i);
        store1(out + i, gv / (1.0f + std::exp(-gv)) * load1(u + i));
      }
    }
  });
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

}  // namespace

void rope_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope_: x must be (T, heads, D), D contiguous");
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 16 == 0, "rope_: head_dim must be a multiple of 16");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T_ &&
                  cos.size(1) == D && cos.is_contiguous() && sin.is_contiguous(),
              "rope_: cos and sin must be contiguous (T, D)");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rope_: tables must have x's dtype");
  if (x.scalar_type() == at::kFloat) {
    rope_rows(ptr<float>(x), T_, H, x.stride(0), x.stride(1), ptr<float>(cos), ptr<float>(sin),
              D);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rope_: float32 or bf16");
    rope_rows(ptr<uint16_t>(x), T_, H, x.stride(0), x.stride(1), ptr<uint16_t>(cos),
              ptr<uint16_t>(sin), D);
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be (T, 2n) with contiguous rows");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto y = at::empty({rows, n}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_rows(ptr<float>(gate_up), rows, gate_up.stride(0), n, ptr<float>(y));
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_mul: float32 or bf16");
    silu_mul_rows(ptr<uint16_t>(gate_up), rows, gate_up.stride(0), n, ptr<uint16_t>(y));
  }
  return y;
}

}  // namespace pdserve
