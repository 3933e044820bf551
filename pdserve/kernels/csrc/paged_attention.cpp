// Attention straight from the paged KV pool, one query row at a time: decode steps, prompt
// chunks and whole prompts all run this one code path.
//
// Each query row belongs to a sequence (`seq_of_row`, or row b = sequence b) and sees that
// sequence's keys [start, len) where len = `lens[row]` (its position + 1) and start is 0 or the
// sliding window's first key. Optionally every row's new K/V is first stored into its slot
// (position len - 1), converted to the pool's dtype (bf16: round to nearest even), before any
// row attends, so the rows of a prompt chunk see each other's keys exactly as they are stored.
// Work items are (row, KV head) pairs. Each item loads every visible key and value of its
// KV head once and uses it for all the query heads that share it (grouped-query attention):
//   1. scores s[g, j] = (q_g * scale) . k_j in float32, for the item's query heads g;
//   2. a safe softmax per head: subtract the row max, exponentiate 8 lanes at a time (exp8);
//   3. out_g = sum_j p[g, j] v_j / sum_j p[g, j], accumulated in float32 registers.
// An item's arithmetic depends only on its own query, position and the stored keys, never on
// its batch mates, on how the prompt was chunked, on whether its prefix came from the prefix
// cache or a transfer, or on how items are split between threads: a token's attention output
// has the same bits in a whole prompt, a chunk, a decode step and a mixed step.
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_ext.h"

namespace pdserve {
namespace {

// Items run on one thread below this many multiply-adds in total (a tiny model's step): waking
// the second thread of a busy 2-core machine can cost a scheduler time slice.
constexpr int64_t kMinParallelMacs = 1 << 20;
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGroup = 4;  // query heads processed together per pass over the keys
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

// Scores of NG query heads (qf: NG rows of D, pre-scaled float32) against the keys at
// `rows` (element offsets of each key in the pool), into scores[g * stride + j].
template <int NG, typename T>
void qk(const float* qf, const T* keys, const T* values, const int64_t* rows, int64_t n,
        int64_t D, float* scores, int64_t stride) {
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetchRows < n) {
      prefetch_row(keys + rows[j + kPrefetchRows], D);
      prefetch_row(values + rows[j + kPrefetchRows], D);
    }
    const T* k = keys + rows[j];
    __m256 acc[NG];
    for (int g = 0; g < NG; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 kv = load8(k + c);
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g)
        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + c), kv, acc[g]);
    }
    float s[NG];
    reduce<NG>(acc, s);
    for (int g = 0; g < NG; ++g) scores[g * stride + j] = s[g];
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

// out_g = sum_j p[g * stride + j] v_j * inv_sum[g], 16 dimensions at a time in registers.
template <int NG, typename T, typename TO>
void pv(const float* p, int64_t stride, const T* values, const int64_t* rows, int64_t n,
        int64_t D, const float* inv_sum, TO* out) {
  for (int64_t c = 0; c < D; c += 16) {
    __m256 lo[NG], hi[NG];
    for (int g = 0; g < NG; ++g) lo[g] = hi[g] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const T* v = values + rows[j] + c;
      const __m256 v0 = load8(v), v1 = load8(v + 8);
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) {
        const __m256 w = _mm256_broadcast_ss(p + g * stride + j);
        lo[g] = _mm256_fmadd_ps(w, v0, lo[g]);
        hi[g] = _mm256_fmadd_ps(w, v1, hi[g]);
      }
    }
    for (int g = 0; g < NG; ++g) {
      const __m256 r = _mm256_set1_ps(inv_sum[g]);
      store8(out + g * D + c, _mm256_mul_ps(lo[g], r));
      store8(out + g * D + c + 8, _mm256_mul_ps(hi[g], r));
    }
  }
}

// Query heads [h0, h0 + NG) of query row b, all of KV head kvh.
template <int NG, typename TQ, typename T>
void head_group(const Problem<TQ, T>& P, int64_t b, int64_t h0, int64_t kvh, const int64_t* rows,
                int64_t n, std::vector<float>& scores) {
  const int64_t D = P.head_dim, padded = (n + 7) / 8 * 8;
  alignas(32) float qf[kMaxGroup * kMaxHeadDim];
  for (int g = 0; g < NG; ++g) {
    const TQ* q = P.q + b * P.q_stride_seq + (h0 + g) * P.q_stride_head;
    for (int64_t c = 0; c < D; c += 8)
      _mm256_storeu_ps(qf + g * D + c, _mm256_mul_ps(load8(q + c), _mm256_set1_ps(P.scale)));
  }
  scores.assign(NG * padded, -std::numeric_limits<float>::infinity());
  const T* layer = P.pool + kvh * P.p_head;
  qk<NG>(qf, layer, layer + P.p_kv, rows, n, D, scores.data(), padded);
  float inv_sum[NG];
  for (int g = 0; g < NG; ++g)
    inv_sum[g] = 1.0f / softmax_numerators(scores.data() + g * padded, padded);
  pv<NG>(scores.data(), padded, layer + P.p_kv, rows, n, D, inv_sum,
         P.out + (b * P.num_heads + h0) * D);
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

template <typename TQ, typename T>
void item(const Problem<TQ, T>& P, int64_t b, int64_t kvh, std::vector<int64_t>& rows,
          std::vector<float>& scores) {
  const int64_t len = P.lens[b];
  const int64_t start = P.window > 0 ? std::max<int64_t>(0, len - P.window) : 0;
  const int64_t n = len - start;
  rows.resize(n);
  // Element offset of key j's K row (V is p_kv further), walking pages and slots without a
  // division per key (two integer divisions per key were ~40% of a "small" item's time).
  const int64_t* pages = P.table + P.seq(b) * P.table_stride;
  int64_t page = start / P.page_size, slot = start % P.page_size;
  for (int64_t j = 0; j < n; ++j) {
    rows[j] = pages[page] * P.p_page + slot * P.p_token;
    if (++slot == P.page_size) slot = 0, ++page;
  }
  const int64_t group = P.num_heads / P.num_kv_heads;
  for (int64_t g = 0; g < group;) {
    const int64_t h0 = kvh * group + g, left = group - g;
    if (left >= 4) { head_group<4>(P, b, h0, kvh, rows.data(), n, scores); g += 4; }
    else if (left >= 2) { head_group<2>(P, b, h0, kvh, rows.data(), n, scores); g += 2; }
    else { head_group<1>(P, b, h0, kvh, rows.data(), n, scores); g += 1; }
  }
}

template <typename TQ, typename T>
void run(const Problem<TQ, T>& P, int64_t num_rows) {
  int64_t num_keys = 0;
  for (int64_t b = 0; b < num_rows; ++b) num_keys += P.lens[b];
  const int64_t items = num_rows * P.num_kv_heads;
  const int64_t macs = 2 * num_keys * P.num_heads * P.head_dim;
  const int64_t grain = macs < kMinParallelMacs ? items : 1;
  if (P.new_kv != nullptr) {  // every row's keys are in place before any row reads them
    at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) store_new_kv(P, i / P.num_kv_heads, i % P.num_kv_heads);
    });
  }
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> rows;
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) item(P, i / P.num_kv_heads, i % P.num_kv_heads, rows, scores);
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
