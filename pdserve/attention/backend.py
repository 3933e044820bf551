"""The attention backend interface (:mod:`pdserve.attention.factory` picks one at start-up).

A backend owns how attention reads and writes the KV page pool: per forward it prepares its
metadata (:meth:`AttentionBackend.init_forward_metadata`), then for each layer it stores the
step's new K/V into the pool and attends, either over packed new tokens and their cached prefix
(:meth:`~AttentionBackend.forward_extend`) or for one new token per sequence
(:meth:`~AttentionBackend.forward_decode`). A mixed step (prompt chunks plus decode rows,
``ForwardBatch.parts``) runs each part through its own method, so decode rows keep the decode
kernel while a long prompt is prefilled beside them. Backends that can be captured in CUDA
graphs also implement the three graph hooks (static buffers for the largest batch, capture at
a bucket size, replay). SGLang's attention backends are the model.

Backends (one per kernel family, each tested against the torch reference):

=========  ======================================================================  ==========
``torch``  page gathers + masked SDPA (:mod:`pdserve.kernels.attention`): reference  any device
``cpp``    the C++ paged kernels, decode and prefill                                  CPU
``triton`` Triton kernels reading the pool in place; graph-capturable decode           CUDA
=========  ======================================================================  ==========
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pdserve.kernels.kv_cache import KVPagePool
from pdserve.model.config import ModelConfig
from pdserve.model.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionConfig:
    """The attention shape of a model plus the limits its batches stay within."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    max_model_len: int
    # The dtype of queries, new K/V and outputs (the model's activations); None: the pool's.
    # float32 over a bf16 pool on CPUs: the new K/V are rounded once, when stored.
    act_dtype: torch.dtype | None = None

    @classmethod
    def of(
        cls, model: ModelConfig, max_model_len: int, act_dtype: torch.dtype | None = None
    ) -> AttentionConfig:
        return cls(
            model.num_heads, model.num_kv_heads, model.head_dim, model.sliding_window,
            max_model_len, act_dtype,
        )  # fmt: skip

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


class AttentionBackend(ABC):
    """Attention over one :class:`KVPagePool` (its per-layer views include the scratch page).

    ``q`` ``(T, H, D)`` and ``new_kv`` ``(T, 2, Hkv, D)`` (each token's K and V) come rotated
    from the model; every method returns ``(T, H, D)``.
    """

    name: str = ""
    supports_cuda_graph: bool = False

    def __init__(self, config: AttentionConfig, kv_pool: KVPagePool) -> None:
        self.config = config
        self.kv_pool = kv_pool
        self.page_size = kv_pool.config.page_size
        self.layer_pools = [kv_pool.layer_view(i) for i in range(kv_pool.config.num_layers)]

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare whatever every layer of this forward shares (called once per forward)."""
        if batch.parts is not None:
            extend, decode = batch.parts
            self.init_extend_metadata(extend)
            self.init_decode_metadata(decode)
        elif batch.is_decode:
            self.init_decode_metadata(batch)
        else:
            self.init_extend_metadata(batch)

    def init_extend_metadata(self, batch: ForwardBatch) -> None:
        """Per-forward preparation of an extend batch (or a mixed step's extend part)."""
        return  # nothing by default

    def init_decode_metadata(self, batch: ForwardBatch) -> None:
        """Per-forward preparation of a decode batch (or a mixed step's decode rows)."""
        return  # nothing by default

    def forward(
        self, layer: int, q: torch.Tensor, new_kv: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        if batch.parts is not None:
            extend, decode = batch.parts
            n = extend.input_ids.shape[0]
            return torch.cat([
                self.forward_extend(layer, q[:n], new_kv[:n], extend),
                self.forward_decode(layer, q[n:], new_kv[n:], decode),
            ])  # fmt: skip
        if batch.is_decode:
            return self.forward_decode(layer, q, new_kv, batch)
        return self.forward_extend(layer, q, new_kv, batch)

    @abstractmethod
    def forward_extend(
        self, layer: int, q: torch.Tensor, new_kv: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Causal attention of packed new tokens over their cached prefix and themselves."""

    @abstractmethod
    def forward_decode(
        self, layer: int, q: torch.Tensor, new_kv: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """One new token per sequence against its whole (windowed) context."""

    # ----- CUDA graph hooks (backends with supports_cuda_graph) ------------------------------

    def init_cuda_graph_state(self, max_num_seqs: int) -> None:
        """Allocate the static buffers decode graphs of up to ``max_num_seqs`` rows share."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graph support")

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        """Like :meth:`init_forward_metadata`, for a decode batch about to be captured: only
        static buffers may be used, as the graph replays with their addresses."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graph support")

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Refresh the metadata of a captured batch whose inputs were just refilled."""
        raise NotImplementedError(f"the {self.name} attention backend has no CUDA graph support")
