"""Picks the attention backend once, at start-up, from the device, dtype and what can run.

Separate from the interface (:mod:`pdserve.attention.backend`) so that the backends import the
interface and the factory imports the backends, with no circle.
"""

from __future__ import annotations

import torch

from pdserve.attention.backend import AttentionBackend, AttentionConfig
from pdserve.kernels import triton as triton_kernels
from pdserve.kernels.kv_cache import KVPagePool
from pdserve.kernels.paged_attention import load_kernel

BACKENDS = ("auto", "torch", "cpp", "triton")


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The backend name for ``requested`` (one of :data:`BACKENDS`) on this device and model.

    ``auto``: the C++ kernel on a CPU where it runs, else torch; Triton on CUDA where it is
    installed, else torch. An explicit choice that cannot run here raises ``ValueError``.
    """
    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; choose one of {BACKENDS}")
    has_cpp = load_kernel(dtype, head_dim, device) is not None
    has_triton = triton_kernels.is_available(device)
    if requested == "auto":
        if device.type == "cpu":
            return "cpp" if has_cpp else "torch"
        return "triton" if has_triton else "torch"
    if requested == "cpp" and not has_cpp:
        raise ValueError(f"the C++ attention kernel does not run here ({device}, {dtype})")
    if requested == "triton" and not has_triton:
        raise ValueError(
            f"the Triton attention backend cannot run on {device}: it needs triton installed, "
            "and on a CPU its interpreter (TRITON_INTERPRET=1)"
        )
    return requested


def create_backend(
    requested: str, config: AttentionConfig, kv_pool: KVPagePool
) -> AttentionBackend:
    """The backend :func:`choose_backend` picks, built over ``kv_pool`` (once, at start-up)."""
    kv = kv_pool.config
    name = choose_backend(requested, kv_pool.kv.device, kv.dtype, kv.head_dim)
    # Imported here: the Triton module compiles kernels at import (interpreter or GPU), and
    # only the chosen backend's kernels should load.
    if name == "triton":
        from pdserve.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(config, kv_pool)
    if name == "cpp":
        from pdserve.attention.cpp_backend import CppAttentionBackend

        return CppAttentionBackend(config, kv_pool)
    from pdserve.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(config, kv_pool)
