// Dense-weight (bf16 or float32) matrix products on AVX2 CPUs, for every row count.
//
// One kernel serves a decode step's few rows and a prefill's thousands, because a row's result
// must not depend on how many rows share the call (pdserve's batch invariance): every output
// element is sum_k w[n, k] * x[m, k] accumulated with one FMA per k, k ascending, in its own
// float32 register lane, whatever the row count, row grouping, blocking or thread count.
//
// torch's bf16 matmul on CPUs without native bf16 instructions converts and re-reads weights
// per row; here each weight is read from memory once per call (per row block) for all rows,
// converted to float32 in registers, and accumulated in float32. Weights are packed once into
// panels of 16 output columns, (ceil(N/16), K, 16), so the inner loop reads memory strictly
// sequentially and broadcasts one input value per FMA pair. For bf16, within a panel row the 16
// columns are interleaved (0, 8, 1, 9, ..., 7, 15): one 32-byte load holds column i in the low
// and column i + 8 in the high half of 32-bit lane i, so a shift and a mask widen both halves
// (no cross-lane shuffles); float32 panels keep the plain column order. Threads take chunks of
// panels as they go (torch's own OpenMP pool; see run()).
//
// Rows go in balanced groups of at most 6 (one pass over a panel per group). What keeps the
// FMAs fed when weights stream from DRAM (measured on the 2-core Zen 4 VM, one thread, 6 rows:
// 50% of the FMA peak -> 90%):
// - each pass prefetches the weights 2 KiB ahead into L1 (the hardware prefetcher alone falls
//   behind a stream consumed this slowly);
// - a group's inputs are copied side by side, (K, rows), so one k's broadcasts share a cache
//   line; rows K floats apart (4 KiB at K = 1024) all map to the same L1 set and evict each
//   other and the weights;
// - packed weights live in 2 MiB transparent huge pages where the OS grants them: streaming
//   hundreds of MB per step through 4 KiB pages costs a TLB miss (a two-level walk in a VM)
//   every 4 KiB (1 row: -28% time, 8 rows: -4%).
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_ext.h"

namespace pdserve {
namespace {

constexpr int64_t kPanel = 16;  // output columns per packed panel (two AVX2 vectors)

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

constexpr int64_t kPrefetchBytes = 2048;  // how far ahead of its reads a pass prefetches

// One packed panel row (16 output columns at one k) widened to float32: columns 0-7 in w0,
// 8-15 in w1.
inline void load_panel_row(const uint16_t* wk, __m256& w0, __m256& w1) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
  w1 = _mm256_castsi256_ps(_mm256_and_si256(wv, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void load_panel_row(const float* wk, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(wk);
  w1 = _mm256_loadu_ps(wk + 8);
}

// MR (1..6) rows times one packed panel: each converted weight vector feeds MR FMAs. Every row
// sums over k in the same order whatever MR is, so a row's result never depends on its batch.
// `x`: the group's inputs, (K, MR). Accumulators are named variables, not an array: GCC spills
// arrays of vectors to the stack.
template <int MR, typename W, typename Out>
inline void panel_rows(const float* x, const W* w, int64_t K, const float* bias16,
                       Out* y, int64_t ldy, int64_t n) {
  static_assert(MR >= 1 && MR <= 6);
  // k steps per 64-byte line of the panel: prefetch once per line.
  constexpr int64_t kStepsPerLine = 64 / (kPanel * sizeof(W));
  const __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z;
  __m256 c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * kPanel;
    // Prefetching past the panel's end reaches the next panel (contiguous) or nothing (a
    // prefetch never faults).
    if (k % kStepsPerLine == 0)
      _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetchBytes, _MM_HINT_T0);
    __m256 w0, w1;
    load_panel_row(wk, w0, w1);
#define PD_ROW(i)                                                 \
    if constexpr (MR > i) {                                       \
      const __m256 xv = _mm256_broadcast_ss(x + k * MR + i);      \
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

// Panel p's 16 bias values (zero-padded) in `bias16`; nullptr without a bias.
inline const float* panel_bias(const float* bias, int64_t N, int64_t p, float* bias16) {
  if (bias == nullptr) return nullptr;
  const int64_t col = p * kPanel, n = std::min(kPanel, N - col);
  std::memset(bias16, 0, kPanel * sizeof(float));
  std::memcpy(bias16, bias + col, n * sizeof(float));
  return bias16;
}

// Row m of x (float32 or bf16, any strides) as float32 into dst[0], dst[step], dst[2 * step]...
void copy_row_strided(const at::Tensor& x, int64_t m, float* dst, int64_t step) {
  const int64_t K = x.size(1), sk = x.stride(1);
  alignas(32) float tmp[8];
  int64_t k = 0;
  if (x.scalar_type() == at::kFloat) {
    const float* src = x.data_ptr<float>() + m * x.stride(0);
    for (; k < K; ++k) dst[k * step] = src[k * sk];
    return;
  }
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr()) + m * x.stride(0);
  if (sk == 1) {
    for (; k + 8 <= K; k += 8) {
      _mm256_store_ps(tmp, bf16x8(src + k));
      for (int j = 0; j < 8; ++j) dst[(k + j) * step] = tmp[j];
    }
  }
  for (; k < K; ++k) dst[k * step] = load1(src + k * sk);
}

// A group of rows and its inputs, (K, rows) float32.
struct RowGroup {
  int64_t first, rows;
  const float* x;
};

// Balanced groups of at most 6 rows (8 rows -> 4 + 4, not 6 + 2: small groups are FMA-latency
// bound, so no group should be much smaller than the others), each with its inputs copied
// side by side into `buf` (a single row is used in place when it is contiguous float32).
// A decode step's rows are a few KB, so converting here costs less than dispatching torch's
// conversion operator (about 15 us per projection on the 2-core test machine).
std::vector<RowGroup> row_groups(const at::Tensor& x, std::vector<float>& buf) {
  const int64_t M = x.size(0), K = x.size(1), num_groups = (M + 5) / 6;
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "linear: float32 or bf16 rows");
  if (M == 1 && x.scalar_type() == at::kFloat && x.stride(1) == 1)
    return {RowGroup{0, 1, x.data_ptr<float>()}};
  std::vector<RowGroup> groups;
  buf.resize(M * K);
  for (int64_t g = 0, m = 0; g < num_groups; ++g) {
    const int64_t rows = (M - m + (num_groups - g) - 1) / (num_groups - g);
    float* dst = buf.data() + m * K;
    for (int64_t r = 0; r < rows; ++r) copy_row_strided(x, m + r, dst + r, rows);
    groups.push_back(RowGroup{m, rows, dst});
    m += rows;
  }
  return groups;
}

// Threads take chunks of panels from a shared counter instead of an even split made up front:
// on a shared 2-core machine a thread is often preempted mid-call (the event loop, the router,
// a neighbour), and with a static split the other would then wait for it at the end. About 8
// chunks per thread keeps the counter cheap and the leftover imbalance small.
constexpr int64_t kChunksPerThread = 8;
constexpr int64_t kMinPanelsPerThread = 4;
// Rows are processed in blocks of at most this many groups (of <= 6 rows): a block's inputs
// (16 groups x 6 rows x K floats: 576 KiB at K = 1536) stay in L2 while every panel of the
// weight streams past them once. Blocking changes which rows share a pass, never a row's sums.
constexpr size_t kGroupsPerBlock = 16;

template <typename W, typename Out>
void run_block(const RowGroup* groups, size_t num_groups, int64_t K, const W* wp, int64_t N,
               const float* bias, Out* y) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t threads = std::clamp<int64_t>(panels / kMinPanelsPerThread, 1,
                                              at::get_num_threads());
  const int64_t chunk = std::max<int64_t>(1, panels / (threads * kChunksPerThread));
  const int64_t num_chunks = (panels + chunk - 1) / chunk;
  std::atomic<int64_t> next_chunk{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next_chunk.fetch_add(1, std::memory_order_relaxed)) < num_chunks;) {
      for (int64_t p = c * chunk, end = std::min(panels, p + chunk); p < end; ++p) {
        const W* w = wp + p * K * kPanel;
        const int64_t col = p * kPanel, n = std::min(kPanel, N - col);
        alignas(32) float bias16[kPanel];
        const float* b = panel_bias(bias, N, p, bias16);
        for (size_t gi = 0; gi < num_groups; ++gi) {
          const RowGroup& g = groups[gi];
          Out* yg = y + g.first * N + col;
          switch (g.rows) {
            case 6: panel_rows<6, W, Out>(g.x, w, K, b, yg, N, n); break;
            case 5: panel_rows<5, W, Out>(g.x, w, K, b, yg, N, n); break;
            case 4: panel_rows<4, W, Out>(g.x, w, K, b, yg, N, n); break;
            case 3: panel_rows<3, W, Out>(g.x, w, K, b, yg, N, n); break;
            case 2: panel_rows<2, W, Out>(g.x, w, K, b, yg, N, n); break;
            default: panel_rows<1, W, Out>(g.x, w, K, b, yg, N, n); break;
          }
        }
      }
    }
  });
}

template <typename W, typename Out>
void run(const std::vector<RowGroup>& groups, int64_t K, const W* wp, int64_t N,
         const float* bias, Out* y) {
  for (size_t g = 0; g < groups.size(); g += kGroupsPerBlock)
    run_block(groups.data() + g, std::min(kGroupsPerBlock, groups.size() - g), K, wp, N, bias, y);
}

}  // namespace

// An uninitialised tensor in memory of its own, 2 MiB aligned and advised to be backed by
// transparent huge pages (a hint: the kernel falls back to 4 KiB pages). Plain torch memory
// when mmap fails.
at::Tensor empty_in_huge_pages(at::IntArrayRef sizes, const at::TensorOptions& options) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = c10::multiply_integers(sizes) * options.dtype().itemsize();
  const size_t kept = (bytes + kHuge - 1) / kHuge * kHuge, mapped = kept + kHuge;
  void* raw = bytes == 0 ? MAP_FAILED
                         : mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                                MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return at::empty(sizes, options);
  char* base = static_cast<char*>(raw);
  const size_t head = (kHuge - reinterpret_cast<uintptr_t>(base) % kHuge) % kHuge;
  char* start = base + head;
  if (head > 0) munmap(base, head);  // give back what aligning the start skipped...
  munmap(start + kept, mapped - head - kept);  // ...and the rest of the spare 2 MiB
  madvise(start, kept, MADV_HUGEPAGE);
  return at::from_blob(start, sizes, [kept](void* p) { munmap(p, kept); }, options);
}

// (N, K) bf16 -> (ceil(N/16), K, 16) bf16, zero-padded columns, each row of 16 interleaved as
// (0, 8, 1, 9, ..., 7, 15); (N, K) float32 -> (ceil(N/16), K, 16) float32 in column order.
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.dtype() == at::kBFloat16 || w.dtype() == at::kFloat),
              "pack: a 2-D bf16 or float32 weight");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto padded = at::zeros({panels * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  auto packed = empty_in_huge_pages({panels, K, kPanel}, w.options());
  if (w.dtype() == at::kFloat) {
    packed.copy_(padded.view({panels, kPanel, K}).permute({0, 2, 1}));
    return packed;
  }
  // (panel, half, i, k) -> (panel, k, i, half): slot 2i + half holds column 8 * half + i.
  packed.view({panels, K, kPanel / 2, 2}).copy_(
      padded.view({panels, 2, kPanel / 2, K}).permute({0, 3, 2, 1}));
  return packed;
}

namespace {
template <typename W>
void run_any_out(const std::vector<RowGroup>& groups, int64_t K, const W* wp, int64_t N,
                 const float* bias, at::Tensor& y) {
  if (y.scalar_type() == at::kFloat) {
    run<W, float>(groups, K, wp, N, bias, y.data_ptr<float>());
  } else {
    TORCH_CHECK(y.scalar_type() == at::kBFloat16, "linear: float32 or bf16 output");
    run<W, uint16_t>(groups, K, wp, N, bias, reinterpret_cast<uint16_t*>(y.data_ptr()));
  }
}
}  // namespace

// x (M, K) float32 or bf16; packed from pack(); bias float32 (N) or None -> (M, N) of out_dtype.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                  const std::optional<at::Tensor>& bias, c10::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && packed.is_contiguous() &&
              (packed.dtype() == at::kBFloat16 || packed.dtype() == at::kFloat));
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(1) == K && packed.size(0) * kPanel >= N);
  std::vector<float> buf;
  const std::vector<RowGroup> groups = row_groups(x, buf);
  const float* bp = nullptr;
  at::Tensor bf;
  if (bias.has_value()) { bf = bias->to(at::kFloat).contiguous(); bp = bf.data_ptr<float>(); }
  auto y = at::empty({M, N}, x.options().dtype(out_dtype));
  if (packed.dtype() == at::kFloat) {
    run_any_out(groups, K, packed.data_ptr<float>(), N, bp, y);
  } else {
    run_any_out(groups, K, reinterpret_cast<const uint16_t*>(packed.data_ptr()), N, bp, y);
  }
  return y;
}

}  // namespace pdserve
