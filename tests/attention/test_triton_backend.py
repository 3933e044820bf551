"""The Triton backend's CUDA-graph state: one static workspace, never freed under a graph."""

from __future__ import annotations

import torch

from pdserve.attention.backend import AttentionConfig
from pdserve.attention.triton_backend import TritonAttentionBackend
from pdserve.kernels.kv_cache import KVCacheConfig, KVPagePool


def test_the_static_workspace_is_allocated_once_so_earlier_graphs_keep_their_pointer() -> None:
    """Each DecodeGraphRunner calls init_cuda_graph_state on the backend it shares; a second
    call used to replace the buffer that graphs captured earlier still read (issue 22)."""
    pool = KVPagePool(KVCacheConfig(2, 2, 32, 8, 4, torch.float32), hugepages=False)
    backend = TritonAttentionBackend(AttentionConfig(4, 2, 32, None, 32), pool)
    backend.init_cuda_graph_state(8)
    first = backend._static_workspace
    assert first is not None
    backend.init_cuda_graph_state(8)
    backend.init_cuda_graph_state(4)  # a smaller runner fits in the same buffer
    assert backend._static_workspace is first
    backend.init_cuda_graph_state(64)  # more rows: a new buffer, the old one kept alive
    assert backend._static_workspace is not first
    assert any(w is first for w in backend._retired_workspaces)
