// Attention straight from the paged KV pool, one query row at a time: decode steps, prompt
// chunks and whole prompts all run this one code path.
//
// Each query row belongs to a sequence (`seq_of_row`, or row b = sequence b) and sees that
// sequence's keys [start, len) where len = `lens[row]` (its position + 1) and start is 0 or the
// sliding window's first key. Optionally every row's new K/V is first stored into its slot
// (position len - 1), converted to the pool's dtype (bf16: round to nearest even), before any
// row attends, so the rows of a prompt chunk see each other's keys exactly as they are stored.
// Work items are (run of rows, KV head) pairs, a run being up to 4 consecutive rows of one
// prompt chunk (a decode row is a run of one). Each item loads every visible key and value of
// its KV head once and uses it for all its rows and all the query heads that share the KV head
// (grouped-query attention):
//   1. scores s[g, j] = (q_g * scale) . k_j in float32, for the item's query heads g;
//   2. a safe softmax per head: subtract the row max, exponentiate 8 lanes at a time (exp8);
//   3. out_g = sum_j p[g, j] v_j / sum_j p[g, j], accumulated in float32 registers.
// A row's arithmetic depends only on its own query, position and the stored keys (each score
// and each output element is its own fma chain, in the same order whatever run the row is
// in), never on its batch mates, its run, how the prompt was chunked, whether its prefix came
// from the prefix cache or a transfer, or how items are split between threads: a token's
// attention output has the same bits in a whole prompt, a chunk, a decode step and a mixed step.
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_ext.h"

namespace pdserve {
namespace {

// Items run on one thread below this many multiply-adds in total (a tiny model's step): waking
// the second thread of a busy 2-core machine can cost a scheduler time slice.
constexpr int64_t kMinParallelMacs = 1 << 17;
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGroup = 4;  // query heads processed together per pass over the keys
// Consecutive rows of one sequence processed together per pass (a prompt chunk's rows): each
// key and value loaded serves them all. At most 8 / heads-per-pass, so a pass's accumulators
// (rows x heads vectors) stay in registers.
constexpr int64_t kMaxRun = 4;
// Rows ahead to prefetch. A step's weights stream through the caches between two layers'
// attention, so keys and values come from memory, one scattered 64-512-byte row at a time,
// which the hardware prefetcher does not follow. The qk pass prefetches the values too, so the
// pv pass finds them in cache ("small", batch 8, 190 keys: 256 -> 160-190 us per layer).
constexpr int64_t kPrefetchRows = 16;

template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64)
    _mm_prefetch(p + b, _MM_HINT_T0);
}

// TQ: the queries', new K/V's and output's element type; T: the pool's.
template <typename TQ, typename T>
struct Problem {
  const TQ* q;
  int64_t q_stride_seq, q_stride_head;
  const T* pool;  // layer view (num_pages, 2, page_size, Hkv, D)
  int64_t p_page, p_kv, p_token, p_head;
  const int64_t* table;
  int64_t table_stride;
  const int64_t* seq_of_row;  // (rows,) or nullptr: row b is sequence b
  const int64_t* lens;  // (rows,): keys visible to each row, its own included
  TQ* out;  // (rows, H, D) contiguous
  const TQ* new_kv;  // (rows, 2, Hkv, D) or nullptr
  int64_t n_seq, n_kv, n_head;
  int64_t num_heads, num_kv_heads, head_dim, page_size, window;
  float scale;

  int64_t seq(int64_t row) const { return seq_of_row != nullptr ? seq_of_row[row] : row; }
};

// Sum each of NG accumulators into out[0..NG).
template <int NG>
inline void reduce(const __m256* acc, float* out) {
  if constexpr (NG == 4) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  } else {
    for (int g = 0; g < NG; ++g) out[g] = hsum(acc[g]);
  }
}

// Scores of NG query heads of R rows (qf[r]: NG rows of D, pre-scaled float32) against keys
// [j0, j1) at `rows` (element offsets of each key in the pool), into scores[r][g * stride + j].
// Each key is loaded once for all R x NG dot products; each score is its own fma chain over
// the dimensions and one reduce<NG>, whatever R is.
template <int NG, int R, typename T>
void qk(const float* const* qf, const T* keys, const T* values, const int64_t* rows, int64_t j0,
        int64_t j1, int64_t D, float* const* scores, int64_t stride) {
  for (int64_t j = j0; j < j1; ++j) {
    if (j + kPrefetchRows < j1) {
      prefetch_row(keys + rows[j + kPrefetchRows], D);
      prefetch_row(values + rows[j + kPrefetchRows], D);
    }
    const T* k = keys + rows[j];
    __m256 acc[R][NG];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) acc[r][g] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 kv = load8(k + c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g)
          acc[r][g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf[r] + g * D + c), kv, acc[r][g]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      float s[NG];
      reduce<NG>(acc[r], s);
      for (int g = 0; g < NG; ++g) scores[r][g * stride + j] = s[g];
    }
  }
}

// In place: p = exp(s - max s) over a row padded with -inf to a multiple of 8; the sum of p.
inline float softmax_numerators(float* s, int64_t padded) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < padded; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
  const __m256 row_max = _mm256_set1_ps(hmax(m));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), row_max));
    _mm256_storeu_ps(s + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  return hsum(sum);
}

// acc[r][g][w] += p[r][g * stride + j] v_j[c + 8w ..] for j in [j0, j1), j ascending.
template <int NG, int R, int W, typename T>
inline void pv_keys(float* const* p, int64_t stride, const T* values, const int64_t* rows,
                    int64_t j0, int64_t j1, int64_t c, __m256 (&acc)[R][NG][W]) {
  for (int64_t j = j0; j < j1; ++j) {
    __m256 v[W];
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) v[w] = load8(values + rows[j] + c + 8 * w);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) {
        const __m256 pj = _mm256_broadcast_ss(p[r] + g * stride + j);
#pragma GCC unroll 2
        for (int w = 0; w < W; ++w) acc[r][g][w] = _mm256_fmadd_ps(pj, v[w], acc[r][g][w]);
      }
  }
}

// out[r] (NG heads of D) = sum_j p[r][g * stride + j] v_j * inv_sum[r][g] over row r's keys
// j < n[r] (n ascending): keys below n[0] are loaded once for all R rows, the later ones
// continue each row's sums. Every output element is its own fma chain over j ascending; W
// vectors of dimensions at a time, as many as keep the sums in registers.
template <int NG, int R, typename T, typename TO>
void pv(float* const* p, int64_t stride, const T* values, const int64_t* n, const int64_t* rows,
        int64_t D, const float (*inv_sum)[NG], TO* const* out) {
  constexpr int W = R * NG <= 4 ? 2 : 1;
  for (int64_t c = 0; c < D; c += 8 * W) {
    __m256 acc[R][NG][W];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g)
#pragma GCC unroll 2
        for (int w = 0; w < W; ++w) acc[r][g][w] = _mm256_setzero_ps();
    pv_keys<NG, R, W>(p, stride, values, rows, 0, n[0], c, acc);
    for (int r = 1; r < R; ++r) {  // the later rows' own keys, one row at a time
      __m256 one[1][NG][W];
      for (int g = 0; g < NG; ++g)
        for (int w = 0; w < W; ++w) one[0][g][w] = acc[r][g][w];
      pv_keys<NG, 1, W>(p + r, stride, values, rows, n[0], n[r], c, one);
      for (int g = 0; g < NG; ++g)
        for (int w = 0; w < W; ++w) acc[r][g][w] = one[0][g][w];
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g)
#pragma GCC unroll 2
        for (int w = 0; w < W; ++w)
          store8(out[r] + g * D + c + 8 * w,
                 _mm256_mul_ps(acc[r][g][w], _mm256_set1_ps(inv_sum[r][g])));
  }
}

// Query heads [h0, h0 + NG) of R consecutive rows b0.. of one sequence (row b0 + r sees keys
// [0, n[r]), n ascending; without a window all rows start at key 0), all of KV head kvh.
template <int NG, int R, typename TQ, typename T>
void head_group(const Problem<TQ, T>& P, int64_t b0, const int64_t* n, int64_t h0, int64_t kvh,
                const int64_t* rows, std::vector<float>& scores) {
  const int64_t D = P.head_dim, stride = (n[R - 1] + 7) / 8 * 8;
  alignas(32) float qbuf[R][kMaxGroup * kMaxHeadDim];
  const float* qf[R];
  float* sc[R];
  TQ* out[R];
  scores.assign(R * NG * stride, -std::numeric_limits<float>::infinity());
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < NG; ++g) {
      const TQ* q = P.q + (b0 + r) * P.q_stride_seq + (h0 + g) * P.q_stride_head;
      for (int64_t c = 0; c < D; c += 8)
        _mm256_storeu_ps(qbuf[r] + g * D + c,
                         _mm256_mul_ps(load8(q + c), _mm256_set1_ps(P.scale)));
    }
    qf[r] = qbuf[r];
    sc[r] = scores.data() + r * NG * stride;
    out[r] = P.out + ((b0 + r) * P.num_heads + h0) * D;
  }
  const T* layer = P.pool + kvh * P.p_head;
  qk<NG, R>(qf, layer, layer + P.p_kv, rows, 0, n[0], D, sc, stride);
  for (int r = 1; r < R; ++r)  // keys only the later rows see
    qk<NG, 1>(qf + r, layer, layer + P.p_kv, rows, n[0], n[r], D, sc + r, stride);
  float inv_sum[R][NG];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < NG; ++g)
      inv_sum[r][g] = 1.0f / softmax_numerators(sc[r] + g * stride, (n[r] + 7) / 8 * 8);
  pv<NG, R>(sc, stride, layer + P.p_kv, n, rows, D, inv_sum, out);
}

// Row `row`'s new K/V (head kvh) into its slot, converted to the pool's element type.
template <typename TQ, typename T>
void store_new_kv(const Problem<TQ, T>& P, int64_t row, int64_t kvh) {
  const int64_t pos = P.lens[row] - 1;
  T* slot = const_cast<T*>(P.pool) +
            P.table[P.seq(row) * P.table_stride + pos / P.page_size] * P.p_page +
            (pos % P.page_size) * P.p_token + kvh * P.p_head;
  const TQ* src = P.new_kv + row * P.n_seq + kvh * P.n_head;
  for (int64_t c = 0; c < P.head_dim; c += 8) {
    store8(slot + c, load8(src + c));
    store8(slot + P.p_kv + c, load8(src + P.n_kv + c));
  }
}

// Calls f(std::integral_constant<int, count>) for count = 1 .. kMaxRun (at most 8 / NG).
template <int NG, typename F>
inline void dispatch_run(int64_t count, F&& f) {
  static_assert(NG >= 1 && NG <= 4);
  if constexpr (NG <= 2) {
    if (count == 4) return f(std::integral_constant<int, 4>{});
    if (count == 3) return f(std::integral_constant<int, 3>{});
  }
  if (count >= 2) return f(std::integral_constant<int, 2>{});
  f(std::integral_constant<int, 1>{});
}

// A run of query rows: `count` consecutive rows from `first`, of one sequence, each one
// position after the previous (a prompt chunk's rows; a decode row is a run of one).
struct Run {
  int64_t first, count;
};

template <typename TQ, typename T>
void item(const Problem<TQ, T>& P, Run run, int64_t kvh, std::vector<int64_t>& rows,
          std::vector<float>& scores) {
  const int64_t last = run.first + run.count - 1, len = P.lens[last];
  const int64_t start = P.window > 0 ? std::max<int64_t>(0, len - P.window) : 0;
  const int64_t n = len - start;
  rows.resize(n);
  // Element offset of key j's K row (V is p_kv further), walking pages and slots without a
  // division per key (two integer divisions per key were ~40% of a "small" item's time).
  const int64_t* pages = P.table + P.seq(last) * P.table_stride;
  int64_t page = start / P.page_size, slot = start % P.page_size;
  for (int64_t j = 0; j < n; ++j) {
    rows[j] = pages[page] * P.p_page + slot * P.p_token;
    if (++slot == P.page_size) slot = 0, ++page;
  }
  int64_t lens[kMaxRun];  // keys each row sees (runs only form without a window)
  for (int64_t r = 0; r < run.count; ++r) lens[r] = P.lens[run.first + r] - start;
  const int64_t group = P.num_heads / P.num_kv_heads;
  for (int64_t g = 0; g < group;) {
    const int64_t h0 = kvh * group + g, left = group - g;
    const auto heads = [&](auto ng) {
      constexpr int NG = decltype(ng)::value;
      for (int64_t r = 0; r < run.count;) {
        dispatch_run<NG>(run.count - r, [&](auto rr) {
          head_group<NG, decltype(rr)::value>(P, run.first + r, lens + r, h0, kvh, rows.data(),
                                              scores);
          r += decltype(rr)::value;
        });
      }
      g += NG;
    };
    if (left >= 4) heads(std::integral_constant<int, 4>{});
    else if (left == 3) heads(std::integral_constant<int, 3>{});
    else if (left == 2) heads(std::integral_constant<int, 2>{});
    else heads(std::integral_constant<int, 1>{});
  }
}

// Rows in runs of at most kMaxRun (see Run); every row of a sliding-window model is its own
// run (its keys start at its own window).
template <typename TQ, typename T>
std::vector<Run> row_runs(const Problem<TQ, T>& P, int64_t num_rows) {
  std::vector<Run> runs;
  for (int64_t b = 0; b < num_rows; ++b) {
    Run* cur = runs.empty() ? nullptr : &runs.back();
    const bool joins = cur != nullptr && P.window == 0 && cur->count < kMaxRun &&
                       P.seq(b) == P.seq(b - 1) && P.lens[b] == P.lens[b - 1] + 1;
    if (joins) ++cur->count;
    else runs.push_back(Run{b, 1});
  }
  return runs;
}

template <typename TQ, typename T>
void run(const Problem<TQ, T>& P, int64_t num_rows) {
  int64_t num_keys = 0;
  for (int64_t b = 0; b < num_rows; ++b) num_keys += P.lens[b];
  const int64_t macs = 2 * num_keys * P.num_heads * P.head_dim;
  if (P.new_kv != nullptr) {  // every row's keys are in place before any row reads them
    const int64_t items = num_rows * P.num_kv_heads;
    at::parallel_for(0, items, macs < kMinParallelMacs ? items : 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) store_new_kv(P, i / P.num_kv_heads, i % P.num_kv_heads);
    });
  }
  const std::vector<Run> runs = row_runs(P, num_rows);
  const int64_t items = static_cast<int64_t>(runs.size()) * P.num_kv_heads;
  at::parallel_for(0, items, macs < kMinParallelMacs ? items : 1, [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> rows;
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i)
      item(P, runs[i / P.num_kv_heads], i % P.num_kv_heads, rows, scores);
  });
}

// Every row sees 1..pages*page_size tokens of a sequence of the table, on pages that exist (a
// bad table would read outside the pool).
void check_tables(const at::Tensor& table, const int64_t* seq_of_row, const at::Tensor& lens,
                  int64_t num_pages, int64_t page_size) {
  const int64_t* t = table.data_ptr<int64_t>();
  const int64_t* l = lens.data_ptr<int64_t>();
  const int64_t max_pages = table.size(1), stride = table.stride(0);
  for (int64_t r = 0; r < lens.size(0); ++r) {
    const int64_t b = seq_of_row != nullptr ? seq_of_row[r] : r;
    TORCH_CHECK(b >= 0 && b < table.size(0), "row ", r, " names sequence ", b,
                " outside the block table");
    TORCH_CHECK(l[r] >= 1 && l[r] <= max_pages * page_size, "context length ", l[r],
                " out of range for ", max_pages, " pages of ", page_size);
    for (int64_t p = 0; p < (l[r] + page_size - 1) / page_size; ++p)
      TORCH_CHECK(t[b * stride + p] >= 0 && t[b * stride + p] < num_pages, "page id ",
                  t[b * stride + p], " outside the pool");
  }
}

template <typename TQ, typename T>
Problem<TQ, T> problem(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table,
                       const int64_t* seq_of_row, const at::Tensor& lens, at::Tensor& out,
                       double scale, int64_t window, const std::optional<at::Tensor>& new_kv) {
  const bool has_new = new_kv.has_value();
  return Problem<TQ, T>{
      reinterpret_cast<const TQ*>(q.data_ptr()), q.stride(0), q.stride(1),
      reinterpret_cast<const T*>(pool.data_ptr()), pool.stride(0), pool.stride(1),
      pool.stride(2), pool.stride(3), table.data_ptr<int64_t>(), table.stride(0), seq_of_row,
      lens.data_ptr<int64_t>(), reinterpret_cast<TQ*>(out.data_ptr()),
      has_new ? reinterpret_cast<const TQ*>(new_kv->data_ptr()) : nullptr,
      has_new ? new_kv->stride(0) : 0, has_new ? new_kv->stride(1) : 0,
      has_new ? new_kv->stride(2) : 0, q.size(1), pool.size(3), q.size(2), pool.size(2), window,
      static_cast<float>(scale)};
}

void check_new_kv(const at::Tensor& new_kv, const at::Tensor& q, const at::Tensor& pool) {
  TORCH_CHECK(new_kv.dim() == 4 && new_kv.size(0) == q.size(0) && new_kv.size(1) == 2 &&
                  new_kv.size(2) == pool.size(3) && new_kv.size(3) == q.size(2) &&
                  new_kv.stride(3) == 1 && new_kv.scalar_type() == q.scalar_type(),
              "new_kv must be (rows, 2, Hkv, D) of q's dtype, D contiguous");
}

template <typename TQ>
void run_for_pool(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table,
                  const int64_t* seq_of_row, const at::Tensor& lens, at::Tensor& out,
                  double scale, int64_t window, const std::optional<at::Tensor>& new_kv) {
  if (pool.scalar_type() == at::kFloat) {
    run(problem<TQ, float>(q, pool, table, seq_of_row, lens, out, scale, window, new_kv),
        q.size(0));
  } else {
    run(problem<TQ, uint16_t>(q, pool, table, seq_of_row, lens, out, scale, window, new_kv),
        q.size(0));
  }
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& layer_pool,
                           const at::Tensor& block_table,
                           const std::optional<at::Tensor>& seq_of_row,
                           const at::Tensor& context_lens, double scale, int64_t sliding_window,
                           const std::optional<at::Tensor>& new_kv) {
  TORCH_CHECK(q.dim() == 3 && layer_pool.dim() == 5 && layer_pool.size(1) == 2,
              "q (rows, H, D) and a layer pool (num_pages, 2, page_size, Hkv, D) expected");
  const auto is_kernel_dtype = [](c10::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16;
  };
  TORCH_CHECK(is_kernel_dtype(q.scalar_type()) && is_kernel_dtype(layer_pool.scalar_type()),
              "q and the pool must each be float32 or bf16");
  TORCH_CHECK(q.scalar_type() == at::kFloat || layer_pool.scalar_type() == at::kBFloat16,
              "bf16 queries need a bf16 pool");
  const int64_t D = q.size(2), num_heads = q.size(1), num_kv_heads = layer_pool.size(3);
  TORCH_CHECK(layer_pool.size(4) == D && D % 16 == 0 && D <= kMaxHeadDim,
              "head_dim must match and be a multiple of 16 up to ", kMaxHeadDim);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.stride(2) == 1 && layer_pool.stride(4) == 1, "head_dim must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 &&
                  block_table.stride(1) == 1,
              "block_table must be (B, max_pages) int64 with contiguous rows");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.dim() == 1 &&
                  context_lens.is_contiguous() && context_lens.size(0) == q.size(0),
              "context_lens must be contiguous (rows,) int64");
  const int64_t* rows_seq = nullptr;
  if (seq_of_row.has_value()) {
    TORCH_CHECK(seq_of_row->scalar_type() == at::kLong && seq_of_row->is_contiguous() &&
                    seq_of_row->dim() == 1 && seq_of_row->size(0) == q.size(0),
                "seq_of_row must be contiguous (rows,) int64");
    rows_seq = seq_of_row->data_ptr<int64_t>();
  } else {
    TORCH_CHECK(block_table.size(0) == q.size(0), "one block-table row per query row");
  }
  check_tables(block_table, rows_seq, context_lens, layer_pool.size(0), layer_pool.size(2));
  if (new_kv.has_value()) check_new_kv(*new_kv, q, layer_pool);
  auto out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  if (q.scalar_type() == at::kFloat) {
    run_for_pool<float>(q, layer_pool, block_table, rows_seq, context_lens, out, scale,
                        sliding_window, new_kv);
  } else {
    run(problem<uint16_t, uint16_t>(q, layer_pool, block_table, rows_seq, context_lens, out,
                                    scale, sliding_window, new_kv),
        q.size(0));
  }
  return out;
}

}  // namespace pdserve
