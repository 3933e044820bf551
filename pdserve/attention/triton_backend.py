"""The GPU backend: Triton kernels that read the page pool in place; graph-capturable decode.

The step's new K/V are stored with one indexed write per layer right before the kernel, in the
cache's dtype (float32 activations over a bf16 cache: rounded once, as on CPUs). Decode
reads lengths, block table and its width from device tensors and keeps its per-split partial
results in a workspace: one per forward when eager, one static buffer shared by every captured
decode graph (layers run one after another on one stream, so they can share it).
"""

from __future__ import annotations

import torch

from pdserve.attention.backend import AttentionBackend, AttentionConfig
from pdserve.kernels.attention import write_layer_kv
from pdserve.kernels.kv_cache import KVPagePool
from pdserve.kernels.triton.decode import (
    num_splits_for,
    paged_decode_attention,
    workspace_floats,
)
from pdserve.kernels.triton.extend import extend_attention
from pdserve.model.forward_batch import ForwardBatch

CPU_NUM_SMS = 2  # the interpreter's stand-in: a few splits, so the merge is exercised


class TritonAttentionBackend(AttentionBackend):
    """Triton paged decode (split-K, GQA-grouped) and extend attention."""

    name = "triton"
    supports_cuda_graph = True

    def __init__(self, config: AttentionConfig, kv_pool: KVPagePool) -> None:
        super().__init__(config, kv_pool)
        self.device = kv_pool.kv.device
        self.num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else CPU_NUM_SMS
        )
        self._static_workspace: torch.Tensor | None = None
        self._retired_workspaces: list[torch.Tensor] = []  # still read by earlier graphs
        self._workspace: torch.Tensor | None = None
        # One split count for every step: a sequence's bits never depend on its batch size.
        self._num_splits = num_splits_for(config.num_kv_heads, self.num_sms)

    def _workspace_floats(self, num_seqs: int) -> int:
        c = self.config
        return workspace_floats(num_seqs, c.num_heads, self._num_splits, c.head_dim)

    def init_decode_metadata(self, batch: ForwardBatch) -> None:
        floats = self._workspace_floats(batch.num_seqs)
        self._workspace = torch.empty(floats, dtype=torch.float32, device=self.device)

    def forward_extend(
        self, layer: int, q: torch.Tensor, new_kv: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        assert batch.q_starts is not None and batch.num_new is not None
        assert batch.num_cached is not None
        pool = self.layer_pools[layer]
        write_layer_kv(pool, batch.page_idx, batch.page_offset, new_kv.to(pool.dtype))
        return extend_attention(
            q, pool, batch.block_table, batch.q_starts, batch.num_new, batch.num_cached,
            batch.max_new, self.config.scale, self.config.sliding_window,
        )  # fmt: skip

    def forward_decode(
        self, layer: int, q: torch.Tensor, new_kv: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        assert batch.context_lens is not None and batch.block_table_width is not None
        assert self._workspace is not None, "init_forward_metadata was not called"
        pool = self.layer_pools[layer]
        write_layer_kv(pool, batch.page_idx, batch.page_offset, new_kv.to(pool.dtype))
        return paged_decode_attention(
            q, pool, batch.block_table, batch.block_table_width, batch.context_lens,
            self.config.scale, self.config.sliding_window, self._num_splits, self._workspace,
        )  # fmt: skip

    # ----- CUDA graph hooks -------------------------------------------------------------------

    def init_cuda_graph_state(self, max_num_seqs: int) -> None:
        # Allocated once per backend: a graph captured earlier (another DecodeGraphRunner on
        # this backend) keeps this pointer, so it is never freed or replaced while in use. A
        # larger need gets a new buffer and the old one stays referenced.
        floats = self._workspace_floats(max_num_seqs)
        if self._static_workspace is not None and self._static_workspace.numel() >= floats:
            return
        if self._static_workspace is not None:
            self._retired_workspaces.append(self._static_workspace)
        self._static_workspace = torch.empty(floats, dtype=torch.float32, device=self.device)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        assert self._static_workspace is not None, "init_cuda_graph_state was not called"
        self._workspace = self._static_workspace

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        # Lengths, tables and the width are read from the refilled static inputs; only the
        # host-side state must match the bucket again for an eager call in between.
        self.init_forward_metadata_capture(batch)
