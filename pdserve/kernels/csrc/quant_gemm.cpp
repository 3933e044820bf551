// float32 rows times GGUF block-quantized weights kept packed (quant_layout.h), float32 out.
//
// One reduction order per output element, whatever the batch. For the scaled types, per
// sub-block j of inputs (k ascending, kSub of them, sharing the column's scale s_j and offset
// b_j): a = the fma chain of q[k] * x[k] from 0, then acc = fma(a, s_j, acc) and, where the type
// has offsets, acc = fma(xs_j, b_j, acc) with xs_j the row's sum of those x (added in order);
// the float types (F32/F16/BF16) are one fma chain of w[k] * x[k]; y = acc + bias. Keeping the
// scales out of the inner loop leaves it a conversion and one fma per weight. Row counts, row
// grouping, how many panels run side by side and thread counts only change which thread
// computes an element and when, never its arithmetic, so a token's result does not depend on
// its batch mates.
// Activations stay float32 (not requantized to 8 bits as llama.cpp does).
//
// Two ways through a panel, chosen by the number of row groups (groups of at most 6 rows, as
// in dense_gemm.cpp), with identical arithmetic:
// - streaming (decode, at most 2 groups): each group reads the packed records and converts
//   them in registers (a second group re-reads the panel from cache), a record prefetched
//   ahead; a group of 1 row walks 4 panels side by side (of 2 rows, 2), so a few rows'
//   accumulator chains do not leave the FMA units waiting on their latency;
// - unpacked (prefill): the panel's quants, scales and offsets are converted once into a
//   per-thread float32 buffer (K x 16, in L2) and every group runs over it.
// Threads take chunks of panels from a shared counter (see dense_gemm.cpp's run() for why).
// Where the CPU has AVX-512, both ways run their twins in quant_avx512.h (16-lane vectors, the
// same fma sequence per element, so the same bits), for every type.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_avx512.h"
#include "quant_layout.h"
#include "quant_panels.h"

namespace pdserve {
namespace {

using namespace quant;

constexpr int64_t kMaxRows = 6;          // rows per group
constexpr int64_t kMaxStreamGroups = 2;  // up to 12 rows: stream the packed panel per group

// MR rows (inputs x (K, MR), sub-block sums xs (K / 32, MR)) times NP panels read through
// src[0..NP): the arithmetic in the header comment.
template <int64_t T, int MR, int NP, typename Src>
inline void rows_times_panels(const float* x, const float* xs, int64_t K, const Src* panels,
                              const float* const* bias16, float* const* y, int64_t ldy,
                              const int64_t* n) {
  using D = Dequant<T>;
  static_assert(!D::kOffset || D::kSub == kOffsetSub);
  static_assert(NP == 1 || MR <= 2, "side by side, the sums must stay in registers");
  Src src[NP];  // local copies: their cursors stay in registers
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p) src[p] = panels[p];
  const __m256 z = _mm256_setzero_ps();
  __m256 acc[NP][MR][2];
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[p][i][0] = acc[p][i][1] = z;
  for (int64_t k0 = 0; k0 < K; k0 += D::kSub) {
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) src[p].begin_sub(k0);
    __m256 blk[NP][MR][2];  // the sub-block's sums (the float types: the whole sums)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        blk[p][i][0] = D::kScaled ? z : acc[p][i][0];
        blk[p][i][1] = D::kScaled ? z : acc[p][i][1];
      }
    for (int64_t k = k0; k < k0 + D::kSub; ++k) {
      // Register use decides the order: one panel's quants against each row's broadcast input
      // (up to 6 rows); or each row's input against each panel's quants in turn (<= 2 rows).
      if constexpr (NP == 1) {
        __m256 q0, q1;
        src[0].quants(k, q0, q1);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          const __m256 xv = _mm256_broadcast_ss(x + k * MR + i);
          blk[0][i][0] = _mm256_fmadd_ps(q0, xv, blk[0][i][0]);
          blk[0][i][1] = _mm256_fmadd_ps(q1, xv, blk[0][i][1]);
        }
      } else {
        __m256 xv[MR];
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) xv[i] = _mm256_broadcast_ss(x + k * MR + i);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
          __m256 q0, q1;
          src[p].quants(k, q0, q1);
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            blk[p][i][0] = _mm256_fmadd_ps(q0, xv[i], blk[p][i][0]);
            blk[p][i][1] = _mm256_fmadd_ps(q1, xv[i], blk[p][i][1]);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      if constexpr (!D::kScaled) {
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) acc[p][i][0] = blk[p][i][0], acc[p][i][1] = blk[p][i][1];
        continue;
      }
      __m256 s0, s1;
      src[p].scales(s0, s1);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        acc[p][i][0] = _mm256_fmadd_ps(blk[p][i][0], s0, acc[p][i][0]);
        acc[p][i][1] = _mm256_fmadd_ps(blk[p][i][1], s1, acc[p][i][1]);
      }
      if constexpr (D::kOffset) {
        __m256 b0, b1;
        src[p].offsets(b0, b1);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          const __m256 xsv = _mm256_broadcast_ss(xs + (k0 / kOffsetSub) * MR + i);
          acc[p][i][0] = _mm256_fmadd_ps(xsv, b0, acc[p][i][0]);
          acc[p][i][1] = _mm256_fmadd_ps(xsv, b1, acc[p][i][1]);
        }
      }
    }
  }
  alignas(32) float tmp[kPanel];
#pragma GCC unroll 8
  for (int p = 0; p < NP; ++p)
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      _mm256_store_ps(tmp, _mm256_add_ps(acc[p][i][0], _mm256_load_ps(bias16[p])));
      _mm256_store_ps(tmp + 8, _mm256_add_ps(acc[p][i][1], _mm256_load_ps(bias16[p] + 8)));
      std::memcpy(y[p] + i * ldy, tmp, n[p] * sizeof(float));
    }
}

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
  const float* x;   // (K, rows)
  const float* xs;  // (K / 32, rows): sums of each 32 inputs, in order
};

// Balanced groups of at most 6 rows, inputs copied side by side (see dense_gemm.cpp's
// row_groups: one k's broadcasts share a cache line, and rows K floats apart would evict each
// other from one L1 set), and each group's sub-block sums.
std::vector<RowGroup> row_groups(const float* x, int64_t M, int64_t K, std::vector<float>& buf) {
  const int64_t num_groups = (M + kMaxRows - 1) / kMaxRows, subs = K / kOffsetSub;
  std::vector<RowGroup> groups;
  buf.resize(M * (K + subs));
  float* xs_all = buf.data() + M * K;
  for (int64_t g = 0, m = 0; g < num_groups; ++g) {
    const int64_t rows = (M - m + (num_groups - g) - 1) / (num_groups - g);
    float* dst = buf.data() + m * K;
    float* xs = xs_all + m * subs;
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = x + (m + r) * K;
      for (int64_t k = 0; k < K; ++k) dst[k * rows + r] = row[k];
      for (int64_t j = 0; j < subs; ++j) {
        float sum = 0.0f;
        for (int64_t k = j * kOffsetSub; k < (j + 1) * kOffsetSub; ++k) sum += row[k];
        xs[j * rows + r] = sum;
      }
    }
    groups.push_back(RowGroup{m, rows, dst, xs});
    m += rows;
  }
  return groups;
}

// Panels one group of `rows` rows walks side by side while streaming: enough accumulator chains
// (rows x panels x 2) to cover the FMA latency, few enough to stay in registers.
inline int64_t panels_side_by_side(int64_t rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }
constexpr int64_t kMaxSideBySide = 4;

// Streaming one group over np panels: runs of panels_side_by_side(rows) panels, each a call of
// kernel(first panel, integral_constant MR, integral_constant NP) (AVX2 and AVX-512 alike).
template <typename Kernel>
void for_each_run(const RowGroup& g, int64_t np, Kernel&& kernel) {
  using std::integral_constant;
  for (int64_t first = 0; first < np;) {
    const int64_t count = std::min(panels_side_by_side(g.rows), np - first);
    dispatch_rows(g.rows, [&](auto mr) {
      constexpr int MR = decltype(mr)::value;
      if constexpr (MR == 1) {
        if (count == 4) return kernel(first, mr, integral_constant<int, 4>{});
        if (count == 3) return kernel(first, mr, integral_constant<int, 3>{});
      }
      if constexpr (MR <= 2) {
        if (count == 2) return kernel(first, mr, integral_constant<int, 2>{});
      }
      kernel(first, mr, integral_constant<int, 1>{});
    });
    first += count;
  }
}

// Panels p .. p + np - 1 (np <= kMaxSideBySide) of one part times every row group.
template <int64_t T>
void run_panels(const Part& part, int64_t p, int64_t np, int64_t K,
                const std::vector<RowGroup>& groups, const float* bias, float* y, int64_t ldy,
                std::vector<float>& scratch) {
  using D = Dequant<T>;
  const int64_t panel_bytes = (K / part.lay.block_k) * part.lay.record_bytes;
  const bool streaming = static_cast<int64_t>(groups.size()) <= kMaxStreamGroups;
  if (streaming) {
    PackedPanel<T> src[kMaxSideBySide];
    PanelCols cols[kMaxSideBySide];
    const float* bias16[kMaxSideBySide];
    float* ys[kMaxSideBySide];
    int64_t ns[kMaxSideBySide];
    for (int64_t i = 0; i < np; ++i) {
      src[i] = PackedPanel<T>{part.packed + (p + i) * panel_bytes, part.lay.record_bytes};
      cols[i].set(part, p + i, bias);
      bias16[i] = cols[i].bias16;
      ns[i] = cols[i].n;
    }
    if (avx512_enabled()) {
      WidePacked<T> wide[kMaxSideBySide];
      for (int64_t i = 0; i < np; ++i) wide[i].panel = src[i];
      for (const RowGroup& g : groups) {
        float* yg = y + g.first * ldy;
        for_each_run(g, np, [&](int64_t first, auto mr, auto side_by_side) {
          rows_times_panels_avx512<T, decltype(mr)::value, decltype(side_by_side)::value>(
              g.x, g.xs, K, wide + first, cols + first, yg, ldy);
        });
      }
      return;
    }
    for (const RowGroup& g : groups) {
      for (int64_t i = 0; i < np; ++i) ys[i] = y + g.first * ldy + cols[i].col;
      for_each_run(g, np, [&](int64_t first, auto mr, auto side_by_side) {
        rows_times_panels<T, decltype(mr)::value, decltype(side_by_side)::value>(
            g.x, g.xs, K, src + first, bias16 + first, ys + first, ldy, ns + first);
      });
    }
    return;
  }
  const int64_t subs = K / D::kSub, panel_floats = (K + 2 * subs) * kPanel;
  const auto unpack_panel = [&](int64_t i, float* q) {
    unpack<T>(part.packed + (p + i) * panel_bytes, K, part.lay.record_bytes, q, q + K * kPanel,
              q + (K + subs) * kPanel);
    return UnpackedPanel{q, q + K * kPanel, q + (K + subs) * kPanel, D::kSub};
  };
  if (avx512_enabled()) {  // unpack two panels at a time, once for all groups
    scratch.resize(2 * panel_floats);
    for (int64_t i = 0; i < np; i += 2) {
      const int64_t count = std::min<int64_t>(2, np - i);
      WideUnpacked src[2];
      PanelCols cols[2];
      for (int64_t c = 0; c < count; ++c) {
        src[c].panel = unpack_panel(i + c, scratch.data() + c * panel_floats);
        cols[c].set(part, p + i + c, bias);
      }
      for (const RowGroup& g : groups) {
        float* yg = y + g.first * ldy;
        dispatch_rows(g.rows, [&](auto mr) {
          constexpr int MR = decltype(mr)::value;
          if (count == 2)
            return rows_times_panels_avx512<T, MR, 2>(g.x, g.xs, K, src, cols, yg, ldy);
          rows_times_panels_avx512<T, MR, 1>(g.x, g.xs, K, src, cols, yg, ldy);
        });
      }
    }
    return;
  }
  scratch.resize(panel_floats);
  for (int64_t i = 0; i < np; ++i) {  // unpack each panel once for all groups
    const UnpackedPanel src = unpack_panel(i, scratch.data());
    PanelCols a;
    a.set(part, p + i, bias);
    const float* bias16[1] = {a.bias16};
    for (const RowGroup& g : groups) {
      float* ys[1] = {y + g.first * ldy + a.col};
      dispatch_rows(g.rows, [&](auto mr) {
        rows_times_panels<T, decltype(mr)::value, 1>(g.x, g.xs, K, &src, bias16, ys, ldy, &a.n);
      });
    }
  }
}

void run_panels_of(const Part& part, int64_t p, int64_t np, int64_t K,
                   const std::vector<RowGroup>& groups, const float* bias, float* y, int64_t ldy,
                   std::vector<float>& scratch) {
  switch (part.type) {
#define PD_TYPE(t) \
    case t: run_panels<t>(part, p, np, K, groups, bias, y, ldy, scratch); break;
    PD_TYPE(F32) PD_TYPE(F16) PD_TYPE(BF16) PD_TYPE(Q8_0) PD_TYPE(Q4_0) PD_TYPE(Q4_1)
    PD_TYPE(Q5_0) PD_TYPE(Q5_1) PD_TYPE(Q4_K) PD_TYPE(Q5_K) PD_TYPE(Q6_K)
#undef PD_TYPE
    default: TORCH_CHECK(false, "quantized matmul: unsupported GGML type ", part.type);
  }
}

// Whether both ways run their AVX-512 twins: where the CPU has it, unless switched off
// (set_avx512: tests compare the two paths' bits on one machine).
std::atomic<bool> g_avx512{__builtin_cpu_supports("avx512f") != 0};

constexpr int64_t kChunksPerThread = 8;
constexpr int64_t kMinPanelsPerThread = 4;

}  // namespace

bool avx512_enabled() { return g_avx512.load(std::memory_order_relaxed); }

bool set_avx512(bool on) {
  const bool previous = avx512_enabled();
  g_avx512.store(on && __builtin_cpu_supports("avx512f"), std::memory_order_relaxed);
  return previous;
}

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
  // Chunks of a multiple of kMaxSideBySide panels (see run_panels).
  const int64_t chunk = std::max<int64_t>(
      kMaxSideBySide, panels / (threads * kChunksPerThread) / kMaxSideBySide * kMaxSideBySide);
  const int64_t num_chunks = (panels + chunk - 1) / chunk;
  std::atomic<int64_t> next_chunk{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t c; (c = next_chunk.fetch_add(1, std::memory_order_relaxed)) < num_chunks;) {
      for (int64_t gp = c * chunk, end = std::min(panels, gp + chunk); gp < end;) {
        const size_t i = std::upper_bound(first_panel.begin(), first_panel.end(), gp) -
                         first_panel.begin() - 1;
        // Up to kMaxSideBySide panels at once, all in this chunk and this part.
        const int64_t p = gp - first_panel[i], part_panels = (parts[i].N + kPanel - 1) / kPanel;
        const int64_t np = std::min({kMaxSideBySide, end - gp, part_panels - p});
        run_panels_of(parts[i], p, np, K, groups, bp, yp, N, scratch);
        gp += np;
      }
    }
  });
  return y;
}

}  // namespace pdserve
