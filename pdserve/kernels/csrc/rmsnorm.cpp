// RMSNorm of rows, and the fused residual add + RMSNorm of a decoder layer, float32 math.
//
// torch's RMSNorm on bf16 rows is about ten small operators (casts, pow, mean, rsqrt, muls);
// here one pass per row computes the mean square in float32 and a second writes
// round(x * rstd * weight). The fused form first stores residual += x, rounded to the residual's
// dtype exactly as torch's in-place add does, and normalises those rounded values, so it equals
// `residual += x; rms_norm(residual)` up to float32 summation order.
#include "cpu_ext.h"

namespace pdserve {
namespace {

// Rows of at least this many elements in total are split between threads; fewer (a decode
// step's few rows) run on the calling thread: waking the pool would cost more than it saves.
constexpr int64_t kMinParallelElems = 1 << 15;

// A (rows, cols) view: rows are (outer, inner) pairs, so (T, heads, head_dim) slices of a
// larger projection output need no copy. The last dimension is contiguous.
struct Rows {
  int64_t num_outer, num_inner, stride_outer, stride_inner, cols;

  static Rows of(const at::Tensor& x) {
    TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "rms_norm: rows must be 2-D or 3-D");
    TORCH_CHECK(x.stride(-1) == 1, "rms_norm: the last dimension must be contiguous");
    if (x.dim() == 2) return {x.size(0), 1, x.stride(0), 0, x.size(1)};
    return {x.size(0), x.size(1), x.stride(0), x.stride(1), x.size(2)};
  }
  int64_t num_rows() const { return num_outer * num_inner; }
  int64_t offset(int64_t row) const {
    return (row / num_inner) * stride_outer + (row % num_inner) * stride_inner;
  }
};

template <typename T>
float sum_squares(const T* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = hsum(acc);
  for (; i < n; ++i) s += load1(x + i) * load1(x + i);
  return s;
}

template <typename T>
void scale_row(const T* x, const T* w, float rstd, int64_t n, T* y) {
  const __m256 r = _mm256_set1_ps(rstd);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    store8(y + i, _mm256_mul_ps(_mm256_mul_ps(load8(x + i), r), load8(w + i)));
  for (; i < n; ++i) store1(y + i, load1(x + i) * rstd * load1(w + i));
}

// residual += x (rounded to T), returning the sum of squares of the rounded values.
template <typename T>
float add_in_place(T* residual, const T* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = round_as(_mm256_add_ps(load8(residual + i), load8(x + i)), residual);
    store8(residual + i, v);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = hsum(acc);
  for (; i < n; ++i) {
    store1(residual + i, load1(residual + i) + load1(x + i));
    s += load1(residual + i) * load1(residual + i);
  }
  return s;
}

int64_t grain_rows(const Rows& rows) {
  const int64_t total = rows.num_rows() * rows.cols;
  return total < kMinParallelElems ? std::max<int64_t>(rows.num_rows(), 1)
                                   : std::max<int64_t>(1, kMinParallelElems / rows.cols);
}

template <typename T>
void norm_rows(const T* x, const Rows& rows, const T* w, float eps, T* y) {
  at::parallel_for(0, rows.num_rows(), grain_rows(rows), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + rows.offset(r);
      const float rstd = 1.0f / std::sqrt(sum_squares(xr, rows.cols) / rows.cols + eps);
      scale_row(xr, w, rstd, rows.cols, y + r * rows.cols);
    }
  });
}

template <typename T>
void add_norm_rows(T* residual, const Rows& rr, const T* x, const Rows& xr, const T* w,
                   float eps, T* y) {
  at::parallel_for(0, rr.num_rows(), grain_rows(rr), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* res = residual + rr.offset(r);
      const float ss = add_in_place(res, x + xr.offset(r), rr.cols);
      const float rstd = 1.0f / std::sqrt(ss / rr.cols + eps);
      scale_row(res, w, rstd, rr.cols, y + r * rr.cols);
    }
  });
}

void check_weight(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rms_norm: float32 or bf16 rows");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.is_contiguous() &&
                  w.size(0) == x.size(-1),
              "rms_norm: weight must be a contiguous (cols,) tensor of the rows' dtype");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_weight(x, weight);
  const Rows rows = Rows::of(x);
  auto y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.scalar_type() == at::kFloat) {
    norm_rows(x.data_ptr<float>(), rows, weight.data_ptr<float>(), eps, y.data_ptr<float>());
  } else {
    auto p = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    norm_rows<uint16_t>(p(x), rows, p(weight), eps, p(y));
  }
  return y;
}

at::Tensor add_rms_norm_(const at::Tensor& residual, const at::Tensor& x,
                         const at::Tensor& weight, double eps) {
  check_weight(residual, weight);
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.sizes() == residual.sizes(),
              "add_rms_norm_: x and residual differ in dtype or shape");
  const Rows rr = Rows::of(residual), xr = Rows::of(x);
  auto y = at::empty(residual.sizes(),
                     residual.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.scalar_type() == at::kFloat) {
    add_norm_rows(residual.data_ptr<float>(), rr, x.data_ptr<float>(), xr,
                  weight.data_ptr<float>(), eps, y.data_ptr<float>());
  } else {
    auto p = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    add_norm_rows<uint16_t>(p(residual), rr, p(x), xr, p(weight), eps, p(y));
  }
  return y;
}

}  // namespace pdserve
