"""The backend factory: one backend chosen at start-up from device, dtype, head size, kernels."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.backend import AttentionConfig
from pdserve.attention.factory import choose_backend, create_backend
from pdserve.kernels.kv_cache import KVCacheConfig, KVPagePool
from pdserve.kernels.paged_attention import load_kernel

CPU = torch.device("cpu")


def has_cpp() -> bool:
    """Asked by the tests that run, never at import (a GPU run collects this file)."""
    return load_kernel(torch.float32, 64) is not None


def test_auto_on_cpu_is_the_cpp_kernel_where_it_runs_else_torch() -> None:
    assert choose_backend("auto", CPU, torch.float32, 64) == ("cpp" if has_cpp() else "torch")
    # A head size the C++ kernel does not take (not a multiple of 16).
    assert choose_backend("auto", CPU, torch.float32, 24) == "torch"


def test_auto_on_cuda_is_triton_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.kernels import triton as triton_kernels

    cuda = torch.device("cuda")
    monkeypatch.setattr(triton_kernels, "is_available", lambda device: True)
    assert choose_backend("auto", cuda, torch.bfloat16, 128) == "triton"
    monkeypatch.setattr(triton_kernels, "is_available", lambda device: False)
    assert choose_backend("auto", cuda, torch.bfloat16, 128) == "torch"


def test_triton_on_a_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        choose_backend("triton", CPU, torch.float32, 64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose_backend("triton", CPU, torch.float32, 64) == "triton"


def test_unknown_or_impossible_backends_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        choose_backend("flash", CPU, torch.float32, 64)
    with pytest.raises(ValueError, match="C\\+\\+"):
        choose_backend("cpp", torch.device("cuda"), torch.float32, 64)


def test_created_backend_reads_the_pool_views_with_the_scratch_page() -> None:
    pool = KVPagePool(KVCacheConfig(2, 1, 32, 5, 4, torch.float32), hugepages=False)
    backend = create_backend("torch", AttentionConfig(2, 1, 32, None, 16), pool)
    assert backend.name == "torch" and not backend.supports_cuda_graph
    assert len(backend.layer_pools) == 2
    assert backend.layer_pools[0].shape == (6, 2, 4, 1, 32)  # 5 pages + the scratch page
