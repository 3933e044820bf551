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
from pdserve.model.forward_batch import ForwardBatch
from pdserve.model.weights import LayerWeights, ModelWeights


class _Layer:
    """A layer's weights as callables (the projections choose their matmul path)."""

    def __init__(self, w: LayerWeights, fp32_min_rows: int | None, dtype: torch.dtype) -> None:
        self.input_norm, self.post_norm = w.input_norm, w.post_norm
        self.q_norm, self.k_norm = w.q_norm, w.k_norm
        self.qkv = Linear(w.qkv, w.qkv_bias, fp32_min_rows, dtype=dtype)
        self.o_proj = Linear(w.o_proj, w.o_bias, fp32_min_rows, dtype=dtype)
        self.gate_up = Linear(w.gate_up, w.gate_up_bias, fp32_min_rows, dtype=dtype)
        self.down = Linear(w.down, w.down_bias, fp32_min_rows, dtype=dtype)


class LlamaModel:
    """Stateless forward pass; all per-sequence state lives in the KV pool the caller passes.

    ``fp32_min_rows``: projections with at least this many input rows run in float32 from
    float32 weight copies (see :mod:`pdserve.kernels.linear`); None keeps one copy.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        max_positions: int,
        dtype: torch.dtype,
        device: str = "cpu",
        fp32_min_rows: int | None = None,
    ) -> None:
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.layers = [_Layer(w, fp32_min_rows, dtype) for w in weights.layers]
        self.lm_head = Linear(weights.lm_head, None, fp32_min_rows, dtype=dtype)
        self.cos, self.sin = rope_tables(
            max_positions, config.head_dim, config.rope_theta, config.rope_scaling, dtype, device
        )

    @property
    def num_extra_bytes(self) -> int:
        """Memory of the float32 weight copies and dequantized weights, if any."""
        linears = [self.lm_head] + [
            p for layer in self.layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        ]
        return sum(p.num_extra_bytes for p in linears)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states ``(T, hidden)`` before the final norm; ``attn`` (its forward metadata
        prepared for ``batch``) stores the tokens' K/V."""
        eps = self.config.rms_norm_eps
        h = F.embedding(batch.input_ids, self.weights.embed)  # ours: updated in place below
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        # h += sublayer(x) and the next norm run as one fused add + norm (add_rms_norm_).
        x = rms_norm(h, self.layers[0].input_norm, eps)
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

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 next-token logits ``(N, vocab)`` for the given (pre-final-norm) rows."""
        with torch.inference_mode():
            x = rms_norm(hidden, self.weights.norm, self.config.rms_norm_eps)
            return self.lm_head(x).float()

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
