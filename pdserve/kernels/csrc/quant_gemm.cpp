// float32 rows times GGUF block-quantized weights kept packed (quant_layout.h), float32 out.
//
// One reduction order per output element, whatever the batch: y[m, n] = bias[n] + the fma
// chain acc = fma(w[k, n], x[m, k], acc) over k = 0..K-1 in order, with w[k, n] dequantized by
// for_each_k (one formula per type). Row counts, row grouping and thread counts only change
// which thread computes an element and when, never its arithmetic, so a token's result does not
// depend on its batch mates. Activations stay float32 (not requantized to 8 bits as llama.cpp
// does).
//
// Two ways through a panel, chosen by the number of row groups (groups of at most 6 rows, as
// in bf16_gemm.cpp), with identical arithmetic:
// - streaming (decode, at most 2 groups): for each group, each record is dequantized in
//   registers and used at once; the packed bytes stream from memory once per call (a second
//   group re-reads the panel from cache), prefetched a record ahead;
// - panel (prefill): the whole panel is unpacked once into a per-thread float32 buffer
//   (K x 16, in L2) and every group runs over it, so unpacking is amortised over the rows.
// Threads take chunks of panels from a shared counter (see bf16_gemm.cpp's run() for why).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_layout.h"

namespace pdserve {
namespace {

using namespace quant;

constexpr int64_t kMaxRows = 6;          // rows per group (12 accumulators + 2 weights + 1 input)
constexpr int64_t kMaxStreamGroups = 2;  // up to 12 rows: stream the packed panel per group

// Both paths below update MR rows' accumulators (named variables: GCC spills arrays of
// vectors) with one k's 16 weights w0, w1 and that k's inputs xk (MR floats) the same way.
#define PD_ROW(xk, i)                                      \
  if constexpr (MR > i) {                                  \
    const __m256 xv = _mm256_broadcast_ss((xk) + i);       \
    c##i##0 = _mm256_fmadd_ps(w0, xv, c##i##0);            \
    c##i##1 = _mm256_fmadd_ps(w1, xv, c##i##1);            \
  }
#define PD_ROWS(xk) \
  PD_ROW(xk, 0) PD_ROW(xk, 1) PD_ROW(xk, 2) PD_ROW(xk, 3) PD_ROW(xk, 4) PD_ROW(xk, 5)
#define PD_ACCUMULATORS                                    \
  const __m256 z = _mm256_setzero_ps();                    \
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z; \
  __m256 c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
#define PD_STORE(i)                                                               \
  if constexpr (MR > i) {                                                         \
    _mm256_store_ps(tmp, _mm256_add_ps(c##i##0, _mm256_load_ps(bias16)));         \
    _mm256_store_ps(tmp + 8, _mm256_add_ps(c##i##1, _mm256_load_ps(bias16 + 8))); \
    std::memcpy(y + i * ldy, tmp, n * sizeof(float));                             \
  }
#define PD_FINISH                                                                 \
  alignas(32) float tmp[kPanel];                                                  \
  PD_STORE(0) PD_STORE(1) PD_STORE(2) PD_STORE(3) PD_STORE(4) PD_STORE(5)

inline void prefetch_record(const uint8_t* rec, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(rec) + off, _MM_HINT_T0);
}

// Streaming: MR rows times one packed panel, each record dequantized in registers and used at
// once. `x` is the group's inputs, (K, MR).
template <int MR, int64_t T>
inline void stream_rows(const float* x, int64_t K, const uint8_t* panel, const Layout& lay,
                        const float* bias16, float* y, int64_t ldy, int64_t n) {
  PD_ACCUMULATORS
  for (int64_t k0 = 0; k0 < K; k0 += lay.block_k, panel += lay.record_bytes) {
    prefetch_record(panel + lay.record_bytes, lay.record_bytes);  // next record (or panel)
    const float* xb = x + k0 * MR;
    for_each_k<T>(panel, [&](int64_t k, __m256 w0, __m256 w1) { PD_ROWS(xb + k * MR) });
  }
  PD_FINISH
}

// Panel: MR rows times a panel already unpacked to float32, w (K, 16).
template <int MR>
inline void unpacked_rows(const float* x, int64_t K, const float* w, const float* bias16,
                          float* y, int64_t ldy, int64_t n) {
  PD_ACCUMULATORS
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * kPanel), w1 = _mm256_loadu_ps(w + k * kPanel + 8);
    PD_ROWS(x + k * MR)
  }
  PD_FINISH
}
#undef PD_ROW
#undef PD_ROWS
#undef PD_ACCUMULATORS
#undef PD_STORE
#undef PD_FINISH

// Calls kernel(std::integral_constant<int, rows>) for rows 1..6.
template <typename Kernel>
inline void dispatch_rows(int64_t rows, Kernel&& kernel) {
  switch (rows) {
    case 6: kernel(std::integral_constant<int, 6>{}); break;
    case 5: kernel(std::integral_constant<int, 5>{}); break;
    case 4: kernel(std::integral_constant<int, 4>{}); break;
    case 3: kernel(std::integral_constant<int, 3>{}); break;
    case 2: kernel(std::integral_constant<int, 2>{}); break;
    default: kernel(std::integral_constant<int, 1>{}); break;
  }
}

struct RowGroup {
  int64_t first, rows;
  const float* x;  // (K, rows)
};

// Balanced groups of at most 6 rows, inputs copied side by side (see bf16_gemm.cpp's
// row_groups: one k's broadcasts share a cache line, and rows K floats apart would evict each
// other from one L1 set). A single row is used in place.
std::vector<RowGroup> row_groups(const float* x, int64_t M, int64_t K, std::vector<float>& buf) {
  if (M == 1) return {RowGroup{0, 1, x}};
  const int64_t num_groups = (M + kMaxRows - 1) / kMaxRows;
  std::vector<RowGroup> groups;
  buf.resize(M * K);
  for (int64_t g = 0, m = 0; g < num_groups; ++g) {
    const int64_t rows = (M - m + (num_groups - g) - 1) / (num_groups - g);
    float* dst = buf.data() + m * K;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; ++k) dst[k * rows + r] = x[(m + r) * K + k];
    groups.push_back(RowGroup{m, rows, dst});
    m += rows;
  }
  return groups;
}

// One part of a fused weight: its packed panels, type and output columns [col0, col0 + N).
struct Part {
  const uint8_t* packed;
  int64_t type, N, col0;
  Layout lay;
};

template <int64_t T>
void run_panel(const Part& part, int64_t p, int64_t K, const std::vector<RowGroup>& groups,
               const float* bias, float* y, int64_t ldy, std::vector<float>& scratch) {
  const Layout lay = part.lay;
  const uint8_t* panel = part.packed + p * (K / lay.block_k) * lay.record_bytes;
  const int64_t col = part.col0 + p * kPanel, n = std::min(kPanel, part.N - p * kPanel);
  alignas(32) float bias16[kPanel] = {};
  if (bias != nullptr) std::memcpy(bias16, bias + col, n * sizeof(float));
  const bool streaming = static_cast<int64_t>(groups.size()) <= kMaxStreamGroups;
  for (const RowGroup& g : groups) {
    float* yg = y + g.first * ldy + col;
    if (streaming) {
      dispatch_rows(g.rows, [&](auto mr) {
        stream_rows<decltype(mr)::value, T>(g.x, K, panel, lay, bias16, yg, ldy, n);
      });
      continue;
    }
    if (&g == &groups.front()) {  // unpack the whole panel once for all groups
      scratch.resize(K * kPanel);
      for (int64_t b = 0; b < K / lay.block_k; ++b)
        unpack_record<T>(panel + b * lay.record_bytes, scratch.data() + b * lay.block_k * kPanel);
    }
    dispatch_rows(g.rows, [&](auto mr) {
      unpacked_rows<decltype(mr)::value>(g.x, K, scratch.data(), bias16, yg, ldy, n);
    });
  }
}

void run_panel_of(const Part& part, int64_t p, int64_t K, const std::vector<RowGroup>& groups,
                  const float* bias, float* y, int64_t ldy, std::vector<float>& scratch) {
  switch (part.type) {
#define PD_TYPE(t) \
    case t: run_panel<t>(part, p, K, groups, bias, y, ldy, scratch); break;
    PD_TYPE(F32) PD_TYPE(F16) PD_TYPE(BF16) PD_TYPE(Q8_0) PD_TYPE(Q4_0) PD_TYPE(Q4_1)
    PD_TYPE(Q5_0) PD_TYPE(Q5_1) PD_TYPE(Q4_K) PD_TYPE(Q5_K) PD_TYPE(Q6_K)
#undef PD_TYPE
    default: TORCH_CHECK(false, "quantized matmul: unsupported GGML type ", part.type);
  }
}

constexpr int64_t kChunksPerThread = 8;
constexpr int64_t kMinPanelsPerThread = 4;

}  // namespace

// x (M, K) float32; parts stacked along N: packed[i] from quant_pack(types[i]) with ns[i]
// output columns; bias float32 (sum ns) or None -> (M, sum ns) float32.
at::Tensor quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& packed,
                        const std::vector<int64_t>& types, const std::vector<int64_t>& ns,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quant_linear: (M, K) float32");
  TORCH_CHECK(!packed.empty() && packed.size() == types.size() && types.size() == ns.size());
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  std::vector<Part> parts;
  std::vector<int64_t> first_panel;  // of each part in the shared panel numbering
  int64_t N = 0, panels = 0;
  for (size_t i = 0; i < packed.size(); ++i) {
    const Layout lay = layout_of(types[i]);
    const int64_t part_panels = (ns[i] + kPanel - 1) / kPanel;
    TORCH_CHECK(packed[i].is_contiguous() && packed[i].scalar_type() == at::kByte &&
                packed[i].numel() == part_panels * (K / lay.block_k) * lay.record_bytes &&
                K % lay.block_k == 0, "quant_linear: part ", i, " does not match K=", K);
    parts.push_back(Part{packed[i].data_ptr<uint8_t>(), types[i], ns[i], N, lay});
    first_panel.push_back(panels);
    N += ns[i];
    panels += part_panels;
  }
  at::Tensor bf;
  const float* bp = nullptr;
  if (bias.has_value()) {
    bf = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bf.numel() == N, "quant_linear: bias of ", bf.numel(), " for N=", N);
    bp = bf.data_ptr<float>();
  }
  auto y = at::empty({M, N}, xc.options());
  if (M == 0) return y;
  std::vector<float> xbuf;
  const std::vector<RowGroup> groups = row_groups(xc.data_ptr<float>(), M, K, xbuf);
  float* yp = y.data_ptr<float>();
  const int64_t threads = std::clamp<int64_t>(panels / kMinPanelsPerThread, 1,
                                              at::get_num_threads());
  const int64_t chunk = std::max<int64_t>(1, panels / (threads * kChunksPerThread));
  const int64_t num_chunks = (panels + chunk - 1) / chunk;
  std::atomic<int64_t> next_chunk{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t c; (c = next_chunk.fetch_add(1, std::memory_order_relaxed)) < num_chunks;) {
      for (int64_t gp = c * chunk, end = std::min(panels, gp + chunk); gp < end; ++gp) {
        const size_t i = std::upper_bound(first_panel.begin(), first_panel.end(), gp) -
                         first_panel.begin() - 1;
        run_panel_of(parts[i], gp - first_panel[i], K, groups, bp, yp, N, scratch);
      }
    }
  });
  return y;
}

}  // namespace pdserve
