"""The model runner's configuration (:class:`~pdserve.model_runner.ModelRunner`): one frozen
dataclass, built from flags by ``config_builder`` and passed down."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.device import DEFAULT_GPU_MEMORY_UTILIZATION


@dataclass(frozen=True)
class RunnerConfig:
    model_dir: str
    # "auto": the checkpoint's own (pdserve.model.dtype); "bfloat16" | "float32"; "float16" on CUDA
    dtype: str = "auto"
    page_size: int = 16
    num_pages: int | None = None  # None: as many as fit in kv_cache_bytes
    # None: 512 MiB on CPU; on CUDA what gpu_memory_utilization leaves (see pdserve.kv_sizing).
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 64
    max_prefill_tokens: int = 2048  # the offline LLM's default step budget
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    device: str = "cpu"  # cpu | cuda | cuda:N, checked at start (pdserve.device)
    # CUDA: the fraction of the device's total memory this worker may use, the KV pool included.
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    # CUDA: bytes held back for CUDA graphs when sizing the pool; None: the default estimate.
    graph_reserve_bytes: int | None = None
    num_threads: int | None = None  # torch intra-op threads of prefill; None: torch's default
    # Threads of decode steps; None: the same as prefill until calibrate_decode_threads() runs.
    decode_threads: int | None = None
    # The KV cache's dtype: "auto" (the weights' dtype: bf16 for a bf16 checkpoint),
    # "bfloat16" or "float32" (on CPUs, where activations are float32; see pdserve.model.dtype).
    kv_cache_dtype: str = "auto"
    # "auto" | "torch" | "cpp" | "triton" (pdserve.attention.backend): auto picks the C++ kernel
    # on CPUs, Triton on CUDA, torch where neither runs.
    attention_backend: str = "auto"
    # Decode without CUDA graphs (always so on CPU, and with a backend that cannot be captured).
    enforce_eager: bool = False
    # False for a worker that never runs decode steps (the prefill role): no decode graphs are
    # captured and no memory is held back for them.
    runs_decode_steps: bool = True
    # Ranks of one engine (pdserve.parallel): rank 0 is this process, the others its children.
    tensor_parallel_size: int = 1
