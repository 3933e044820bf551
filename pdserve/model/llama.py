"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

One implementation, read top to bottom like the paper: embed, then per layer
``h += Attn(RMSNorm(h))`` and ``h += MLP(RMSNorm(h))``, then a final RMSNorm and the LM head.
Per-architecture differences are data, not code paths: QKV bias (Qwen2), per-head q/k RMSNorm
(Qwen3), a sliding attention window (Mistral), rope scaling (Llama 3). Projections are fused
(one QKV and one gate/up matmul per layer).

Attention goes through one :class:`~pdserve.attention.backend.AttentionBackend`, chosen once at
start-up (C++ paged decode on CPUs, Triton on GPUs, the torch reference elsewhere): the model
hands it each layer's rotated queries and new K/V and never asks which device it runs on. Where
the C++ CPU kernels run, norms, rope, the SiLU gate and each residual add with the norm after
it are one kernel each; elsewhere the same math runs in torch.

Two dtypes: the weights' (as stored: bf16, float32, or GGUF blocks) and the activations'
(``act_dtype``). On CPUs activations are float32 (residual stream, norms, rope, attention
arithmetic, logits) over bf16 weights: nothing rounds to bf16 between layers, and only the KV
cache stores bf16, written once. On CUDA activations stay in the weights' dtype (tensor cores)
and the logits are float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.attention.backend import AttentionBackend
from pdserve.kernels.elementwise import rope_, silu_mul
from pdserve.kernels.linear import Linear
from pdserve.kernels.rmsnorm import add_rms_norm_, rms_norm
from pdserve.kernels.rope import rope_tables
from pdserve.model.config import ModelConfig
from pdserve.model.cpp_layers import CppDecoderLayers, cpp_decoder_layers
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.quantized import QuantizedTensor
from pdserve.model.weights import LayerWeights, ModelWeights, Projection, num_bytes
from pdserve.parallel.mapping import (
    block_size,
    gate_up_rows,
    local_config,
    mlp_bounds,
    qkv_rows,
    reduction_segments,
    row_segments,
    take_rows,
    take_vector,
)
from pdserve.parallel.row_parallel import TP, RowParallelLinear
from pdserve.parallel.vocab_parallel import VocabParallelHead


def _vector(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return t.to(dtype) if t is not None else None


class _Layer:
    """A layer's weights (this rank's shard of them) as callables; norm weights in the
    activations' dtype. ``cfg`` is the whole model's; see pdserve.parallel.mapping."""

    def __init__(self, w: LayerWeights, act_dtype: torch.dtype, cfg: ModelConfig, tp: TP) -> None:
        segments = reduction_segments(cfg)
        self.input_norm, self.post_norm = w.input_norm.to(act_dtype), w.post_norm.to(act_dtype)
        self.q_norm, self.k_norm = _vector(w.q_norm, act_dtype), _vector(w.k_norm, act_dtype)
        # MLP segments on the down projection's block bounds: no down segment cuts a block
        mlp = mlp_bounds(cfg.intermediate_size, segments, block_size(w.down))
        qkv, gate_up = qkv_rows(cfg, tp.size, tp.rank), gate_up_rows(cfg, tp.size, tp.rank, mlp)
        self.qkv = _column_parallel(w.qkv, w.qkv_bias, qkv, act_dtype, tp)
        self.gate_up = _column_parallel(w.gate_up, w.gate_up_bias, gate_up, act_dtype, tp)
        self.o_proj = _row_parallel(w.o_proj, w.o_bias, cfg.q_size, segments, act_dtype, tp)
        inter = cfg.intermediate_size
        self.down = _row_parallel(w.down, w.down_bias, inter, segments, act_dtype, tp, mlp)


def _column_parallel(
    w: Projection, bias: torch.Tensor | None, rows: list[tuple[int, int]],
    act_dtype: torch.dtype, tp: TP,
) -> Linear:  # fmt: skip
    if tp.size > 1:
        w, bias = take_rows(w, rows), take_vector(bias, rows)
    return Linear(w, bias, act_dtype)


def _row_parallel(
    w: Projection, bias: torch.Tensor | None, in_features: int, num_segments: int,
    act_dtype: torch.dtype, tp: TP, bounds: list[int] | None = None,
) -> Linear | RowParallelLinear:  # fmt: skip
    if num_segments == 1:  # one fused sum, as every TP1-only model (SmolLM2's 9 heads) has
        return Linear(w, bias, act_dtype)
    segments = row_segments(w, in_features, num_segments, tp.size, tp.rank, bounds)
    return RowParallelLinear(segments, bias, act_dtype, tp.group)


def activation_dtype(weight_dtype: torch.dtype, device: str | torch.device) -> torch.dtype:
    """float32 on CPUs (the kernels read bf16 weights into float32 registers anyway); the
    weights' own dtype on accelerators."""
    return torch.float32 if torch.device(device).type == "cpu" else weight_dtype


class LlamaModel:
    """Stateless forward pass; all per-sequence state lives in the KV pool the caller passes.

    ``dtype``: the weights'; activations are :func:`activation_dtype` of it on ``device``.
    ``tp``: the rank's shard (its heads and MLP columns; the LM head on rank 0 only, which
    alone samples); ``config`` is then the rank's view (``mapping.local_config``).
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        max_positions: int,
        dtype: torch.dtype,
        device: str = "cpu",
        tp: TP | None = None,
    ) -> None:
        tp = tp or TP()
        self.tp = tp
        self.config = local_config(config, tp.size, tp.rank)
        self.weights = weights
        self.dtype = dtype
        self.device = torch.device(device)
        self.act_dtype = activation_dtype(dtype, device)
        self.layers = [_Layer(w, self.act_dtype, config, tp) for w in weights.layers]
        self.lm_head: Linear | VocabParallelHead = (
            Linear(weights.lm_head, None, self.act_dtype)
            if tp.size == 1
            else VocabParallelHead(weights.lm_head, config.vocab_size, self.act_dtype, tp)
        )
        self.final_norm = weights.norm.to(self.act_dtype)
        if tp.size > 1:  # a rank keeps its shards only (and the embedding table, for lookups)
            self.weights = ModelWeights(weights.embed, [], weights.norm, weights.embed)
        self._cpp_layers: tuple[AttentionBackend, CppDecoderLayers | None] | None = None
        self.cos, self.sin = rope_tables(
            max_positions, config.head_dim, config.rope_theta, config.rope_scaling,
            self.act_dtype, device,
        )  # fmt: skip

    @property
    def num_weight_bytes(self) -> int:
        """Memory the weights occupy as they run: each projection's (packed, quantized or dense)
        copy, the embedding table and the norms."""
        linears: list[Linear | RowParallelLinear | VocabParallelHead] = [self.lm_head]
        vectors = [self.final_norm]
        for layer in self.layers:
            linears += [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
            vectors += [layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm]
        dense = sum(t.numel() * t.element_size() for t in vectors if t is not None)
        return num_bytes(self.weights.embed) + dense + sum(p.num_bytes for p in linears)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states ``(T, hidden)`` before the final norm; ``attn`` (its forward metadata
        prepared for ``batch``) stores the tokens' K/V."""
        eps = self.config.rms_norm_eps
        # (T, hidden) in the activations' dtype, ours: updated in place below
        h = self._embed(batch.input_ids)
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        # h += sublayer(x) and the next norm run as one fused add + norm (add_rms_norm_).
        x = rms_norm(h, self.layers[0].input_norm, eps)
        cpp_layers = self._cpp_layers_for(attn)
        if cpp_layers is not None and cpp_layers.run(h, x, cos, sin, batch):
            return h  # the same loop, in C++ (model/cpp_layers.py)
        for i, layer in enumerate(self.layers):
            q, new_kv = self._qkv(layer, x, cos, sin)
            out = attn.forward(i, q, new_kv, batch)  # (T, H, D)
            x = add_rms_norm_(h, layer.o_proj(out.flatten(1)), layer.post_norm, eps)
            mlp = self._mlp(layer, x)
            if i + 1 < len(self.layers):
                x = add_rms_norm_(h, mlp, self.layers[i + 1].input_norm, eps)
            else:
                h += mlp  # the final norm runs in logits(), on the rows that need it
        return h

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The tokens' rows of the embedding table, in the activations' dtype. A quantized
        table dequantizes only the looked-up rows, to the weights' dtype first: the values a
        dense table of that dtype would hold."""
        table = self.weights.embed
        if isinstance(table, QuantizedTensor):
            rows = table.dequantize_rows(ids, torch.float32).to(self.dtype)
            return rows.to(device=ids.device, dtype=self.act_dtype)
        return F.embedding(ids, table).to(self.act_dtype)

    def _cpp_layers_for(self, attn: AttentionBackend) -> CppDecoderLayers | None:
        """The C++ decoder loop for this backend, built on first use (None: the Python loop)."""
        if self._cpp_layers is None or self._cpp_layers[0] is not attn:
            self._cpp_layers = (
                attn,
                cpp_decoder_layers(self.config, self.layers, self.act_dtype, attn, self.device),
            )
        return self._cpp_layers[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 next-token logits ``(N, vocab)`` for the given (pre-final-norm) rows."""
        with torch.inference_mode():
            x = rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
            logits = self.lm_head(x)
            assert logits is not None, "only tensor-parallel rank 0 computes logits"
            return logits.float()

    def join_logits(self, num_rows: int) -> None:
        """Tensor-parallel rank r > 0: this rank's vocabulary shard of rank 0's next
        :meth:`logits` call, over ``num_rows`` rows rank 0 hands over."""
        with torch.inference_mode():
            self.lm_head(torch.zeros(num_rows, self.config.hidden_size, dtype=self.act_dtype))

    def _qkv(
        self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected, normed (Qwen3) and rotated ``q (T,H,D)`` and ``kv (T,2,Hkv,D)``.

        Rope writes back into the fused projection output, so K and V stay side by side and
        reach the pool in one indexed write.
        """
        cfg = self.config
        num_heads, num_kv = cfg.num_heads, cfg.num_kv_heads
        heads = layer.qkv(x).view(x.shape[0], num_heads + 2 * num_kv, cfg.head_dim)
        kv = heads[:, num_heads:].unflatten(1, (2, num_kv))
        if layer.q_norm is not None and layer.k_norm is not None:
            q = rms_norm(heads[:, :num_heads], layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(heads[:, num_heads : num_heads + num_kv], layer.k_norm, cfg.rms_norm_eps)
            rope_(kv[:, 0].copy_(k), cos, sin)
            return rope_(q, cos, sin), kv
        # q and k are adjacent heads of the fused output: rotate them in one go, in place.
        rope_(heads[:, : num_heads + num_kv], cos, sin)
        return heads[:, :num_heads], kv

    @staticmethod
    def _mlp(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        return layer.down(silu_mul(layer.gate_up(x)))
