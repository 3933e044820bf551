"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

One implementation, read top to bottom like the paper: embed, then per layer
``h += Attn(RMSNorm(h))`` and ``h += MLP(RMSNorm(h))``, then a final RMSNorm and the LM head.
Per-architecture differences are data, not code paths: QKV bias (Qwen2), per-head q/k RMSNorm
(Qwen3), a sliding attention window (Mistral), rope scaling (Llama 3). Projections are fused
(one QKV and one gate/up matmul per layer).

Where the C++ CPU kernels run (:mod:`pdserve.kernels.cpu_ext`), decode attention reads the page
pool in place and stores the step's K/V itself (:mod:`pdserve.kernels.paged_decode`), and norms,
rope, the SiLU gate and each residual add with the norm after it are one kernel each. Without
them the same math runs in torch (decode K/V copied out of the pages by
:class:`~pdserve.kernels.decode_context.DecodeContext`, the runner's key mask, SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.attention import (
    PrefillSeqMeta,
    decode_attention,
    prefill_attention,
    write_layer_kv,
)
from pdserve.kernels.decode_context import DecodeContext
from pdserve.kernels.elementwise import rope_, silu_mul
from pdserve.kernels.kv_cache import KVPagePool
from pdserve.kernels.linear import Linear
from pdserve.kernels.paged_decode import load_kernel, paged_decode_attention
from pdserve.kernels.rmsnorm import add_rms_norm_, rms_norm
from pdserve.kernels.rope import rope_tables
from pdserve.model.config import ModelConfig
from pdserve.model.weights import LayerWeights, ModelWeights


@dataclass
class PagedKV:
    """The page pool tensor and its per-layer ``(num_pages, 2, page_size, Hkv, D)`` K/V views.

    Built once (:meth:`of`): the pool is never reallocated, so the views stay valid.
    """

    pool: torch.Tensor  # (num_pages, num_layers, 2, page_size, Hkv, D)
    layer_pools: list[torch.Tensor]  # per layer (num_pages, 2, page_size, Hkv, D): K and V

    @classmethod
    def of(cls, kv_pool: KVPagePool) -> PagedKV:
        return cls(kv_pool.kv, [kv_pool.layer_view(i) for i in range(kv_pool.config.num_layers)])


@dataclass
class ForwardBatch:
    """What one forward needs besides token ids: positions, KV slots, attention layout.

    Exactly one of ``prefill_seqs`` (packed variable-length prefill) or ``block_table`` +
    ``context_lens`` (+ ``key_mask``) (one token per sequence decode) is set.
    """

    positions: torch.Tensor  # (T,) int64
    page_idx: torch.Tensor  # (T,) int64: the page each new token's K/V goes to
    page_offset: torch.Tensor  # (T,) int64: the slot inside that page
    prefill_seqs: list[PrefillSeqMeta] | None = None
    block_table: torch.Tensor | None = None  # (B, max_pages) int64
    context_lens: torch.Tensor | None = None  # (B,) int64, including the new token
    # (B, max_pages * page_size), bool or additive (see decode_attention); None: all visible.
    # Only the torch decode path reads it; the paged kernel derives visibility from the lengths.
    key_mask: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.block_table is not None


class _Layer:
    """A layer's weights as callables (the projections choose their matmul path)."""

    def __init__(self, w: LayerWeights, fp32_min_rows: int | None) -> None:
        self.input_norm, self.post_norm = w.input_norm, w.post_norm
        self.q_norm, self.k_norm = w.q_norm, w.k_norm
        self.qkv = Linear(w.qkv, w.qkv_bias, fp32_min_rows)
        self.o_proj = Linear(w.o_proj, w.o_bias, fp32_min_rows)
        self.gate_up = Linear(w.gate_up, w.gate_up_bias, fp32_min_rows)
        self.down = Linear(w.down, w.down_bias, fp32_min_rows)


class LlamaModel:
    """Stateless forward pass; all per-sequence state lives in the KV pool the caller passes.

    ``fp32_min_rows``: projections with at least this many input rows run in float32 from
    float32 weight copies (see :mod:`pdserve.kernels.linear`); None keeps one copy.
    ``use_decode_kernel``: decode attention through the paged C++ kernel where it runs;
    ``decode_kernel`` is None when the torch path is used instead.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        max_positions: int,
        dtype: torch.dtype,
        device: str = "cpu",
        fp32_min_rows: int | None = None,
        use_decode_kernel: bool = True,
    ) -> None:
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.scale = config.head_dim**-0.5
        self.decode_kernel = (
            load_kernel(dtype, config.head_dim, device) if use_decode_kernel else None
        )
        self.layers = [_Layer(w, fp32_min_rows) for w in weights.layers]
        self.lm_head = Linear(weights.lm_head, None, fp32_min_rows)
        self.cos, self.sin = rope_tables(
            max_positions, config.head_dim, config.rope_theta, config.rope_scaling, dtype, device
        )

    @property
    def num_extra_bytes(self) -> int:
        """Memory of the float32 weight copies, if any."""
        linears = [self.lm_head] + [
            p for layer in self.layers for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        ]
        return sum(p.num_extra_bytes for p in linears)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: PagedKV) -> torch.Tensor:
        """Hidden states ``(T, hidden)`` before the final norm; writes the tokens' K/V."""
        eps = self.config.rms_norm_eps
        h = F.embedding(input_ids, self.weights.embed)  # ours: updated in place below
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]
        context = None
        if batch.is_decode and self.decode_kernel is None:
            assert batch.block_table is not None and batch.context_lens is not None
            context = DecodeContext(kv.pool, batch.block_table, batch.context_lens)
        # h += sublayer(x) and the next norm run as one fused add + norm (add_rms_norm_).
        x = rms_norm(h, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            attn = self._attention(i, layer, x, cos, sin, batch, kv, context)
            x = add_rms_norm_(h, attn, layer.post_norm, eps)
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
        reach the pool (and the decode context) in one indexed write each.
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

    def _attention(
        self,
        index: int,
        layer: _Layer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv: PagedKV,
        context: DecodeContext | None,
    ) -> torch.Tensor:
        q, new_kv = self._qkv(layer, x, cos, sin)
        if batch.is_decode and self.decode_kernel is not None:
            assert batch.block_table is not None and batch.context_lens is not None
            # The kernel stores the new K/V into their slots itself (no separate indexed write).
            out = paged_decode_attention(
                self.decode_kernel, q, kv.layer_pools[index], batch.block_table,
                batch.context_lens, self.scale, self.config.sliding_window, new_kv,
            )  # fmt: skip
            return layer.o_proj(out.reshape(x.shape[0], self.config.q_size))
        write_layer_kv(kv.layer_pools[index], batch.page_idx, batch.page_offset, new_kv)
        if context is not None:
            keys, values = context.layer(index, new_kv)
            out = decode_attention(q, keys, values, batch.key_mask, self.scale)
        else:
            assert batch.prefill_seqs is not None
            k_cache, v_cache = kv.layer_pools[index].unbind(1)
            out = prefill_attention(
                q, new_kv[:, 0], new_kv[:, 1], batch.prefill_seqs, k_cache, v_cache, self.scale,
                self.config.sliding_window,
            )  # fmt: skip
        return layer.o_proj(out.reshape(x.shape[0], self.config.q_size))

    @staticmethod
    def _mlp(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        return layer.down(silu_mul(layer.gate_up(x)))
