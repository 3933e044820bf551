// A model's decoder layers as one call on CPUs: per layer the same kernels, in the same order and
// on the same operands as the Python loop of model/llama.py (QKV projection, rope in place,
// paged attention storing the new K/V, output projection with the fused residual add + norm,
// SiLU-gated MLP, add + the next layer's norm), so each token gets the same bits either way.
// What the loop saves is the interpreter between kernels: at 30 layers and ~10 kernels each, a
// decode step of a small model spent about a millisecond in Python and torch's dispatch alone.
#include "cpu_ext.h"

namespace pdserve {

at::Tensor Projection::operator()(const at::Tensor& x) const {
  if (!segments.empty()) {  // RowParallelLinear.__call__, op for op
    const int64_t num_segments = static_cast<int64_t>(segments.size());
    std::vector<at::Tensor> parts(num_segments);
    auto run = [&](int64_t i) {
      const int64_t lo = bounds[4 * i], hi = bounds[4 * i + 1];
      const int64_t before = bounds[4 * i + 2], after = bounds[4 * i + 3];
      at::Tensor in;
      if (before == 0 && after == 0) {
        in = x.narrow(1, lo, hi - lo).contiguous();
      } else {
        in = at::zeros({x.size(0), before + hi - lo + after}, x.options());
        in.narrow(1, before, hi - lo).copy_(x.narrow(1, lo, hi - lo));
      }
      parts[i] = segments[i](in);
    };
    // A few rows (decode) and segments a multiple of the threads: each thread runs whole
    // segments, one parallel region instead of one per segment (a 1-row step paid ~20 us a
    // region; Qwen2.5-1.5B c1 +5.8% -> +1.8% over one fused sum). More rows keep each kernel's
    // own split (measured better at 8 rows). A kernel's bits do not depend on its thread
    // count, so either way this is the Python loop's result.
    const int64_t threads = at::get_num_threads();
    if (threads > 1 && num_segments % threads == 0 && x.size(0) <= 4) {
      at::parallel_for(0, num_segments, 1, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) run(i);
      });
    } else {
      for (int64_t i = 0; i < num_segments; ++i) run(i);
    }
    while (parts.size() > 1) {
      std::vector<at::Tensor> next;
      for (size_t i = 0; i + 1 < parts.size(); i += 2) next.push_back(parts[i] + parts[i + 1]);
      parts = std::move(next);
    }
    return bias ? parts[0] + *bias : parts[0];
  }
  if (!types.empty()) return quant_linear(x, packed, types, ns, bias);
  return linear(x, dense, out_features, bias, at::kFloat);
}

void DecoderStack::forward_(const at::Tensor& h, const at::Tensor& x0, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& block_table,
                            const std::optional<at::Tensor>& seq_of_row,
                            const at::Tensor& lens) const {
  TORCH_CHECK(h.scalar_type() == at::kFloat && x0.scalar_type() == at::kFloat &&
              h.is_contiguous() && x0.is_contiguous() && h.sizes() == x0.sizes(),
              "decoder stack: float32 (T, hidden) residual and normed rows");
  TORCH_CHECK(pools.size() == layers.size(), "decoder stack: one KV pool view per layer");
  const int64_t T = x0.size(0), num_rotated = num_heads + num_kv_heads;
  at::Tensor x = x0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecoderLayer& layer = layers[i];
    // q and k are adjacent heads of the fused output: rotated in one go, in place; K and V
    // stay side by side for the pool.
    const at::Tensor heads = layer.qkv(x).view({T, num_rotated + num_kv_heads, head_dim});
    rope_(heads.narrow(1, 0, num_rotated), cos, sin);
    const at::Tensor q = heads.narrow(1, 0, num_heads);
    const at::Tensor kv = heads.narrow(1, num_heads, 2 * num_kv_heads).unflatten(1, {2, num_kv_heads});
    const at::Tensor out =
        paged_attention(q, pools[i], block_table, seq_of_row, lens, scale, sliding_window, kv);
    x = add_rms_norm_(h, layer.o_proj(out.flatten(1)), layer.post_norm, eps);
    const at::Tensor mlp = layer.down(silu_mul(layer.gate_up(x)));
    if (i + 1 < layers.size()) {
      x = add_rms_norm_(h, mlp, layers[i + 1].input_norm, eps);
    } else {
      h.add_(mlp);  // the final norm runs with the logits, on the rows that need it
    }
  }
}

}  // namespace pdserve
