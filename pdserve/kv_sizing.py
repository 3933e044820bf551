"""How many KV pages a worker gets: a fixed byte budget on CPU, free device memory on CUDA.

On CUDA the pool takes what is left of this worker's share of the device once everything else
is in place, as nano-vllm and vLLM size theirs::

    share     = min(total * gpu_memory_utilization, free when the worker started)
    kv_bytes  = share - weights - peak activations - other (non-torch) memory - graph reserve
    num_pages = kv_bytes // page_bytes

``free when the worker started`` caps the share on a device other processes already use (a
second worker on the same GPU that starts after the first sees the first one's memory as
used). Peak activations come from a warm-up forward of ``max_prefill_tokens`` tokens (and a
sampling pass at ``max_num_seqs`` rows) measured with ``torch.cuda.max_memory_allocated``.
The arithmetic is :func:`plan_kv_pages`, pure and unit-tested; the runner measures its inputs.

``other`` is a device-wide difference (``cudaMemGetInfo`` cannot tell processes apart), so
workers that share a GPU (``pdserve up --device cuda`` starts prefill and decode at once) take
turns: each holds :func:`sizing_lock` from its first reading of free memory until its pool and
graphs are allocated. Otherwise the worker that finished its warm-up second would count the
first one's pool as its own overhead and get almost no pages (vLLM issue 55827).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.file_lock import exclusive_file_lock
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 512 << 20
# CUDA graphs of the decode buckets share one memory pool that holds about the largest
# bucket's activations (a few hundred MiB at batch 64-256 on 1-8B models); reserved before
# sizing unless a measured figure or --enforce-eager says otherwise.
DEFAULT_GRAPH_RESERVE_BYTES = 512 << 20
# How long a worker waits for another on its GPU to finish sizing (weights load, warm-up and
# graph capture of a large model can take minutes).
SIZING_LOCK_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class DeviceMemory:
    """What ``torch.cuda.mem_get_info`` said when the worker started (bytes)."""

    total_bytes: int
    free_at_start_bytes: int


@dataclass(frozen=True)
class KVSizing:
    """The breakdown behind a CUDA pool size, logged at start-up (all bytes)."""

    total_bytes: int
    utilization: float
    share_bytes: int  # min(total * utilization, free at start)
    weights_bytes: int
    activation_bytes: int
    other_bytes: int  # non-torch allocations since start (cuBLAS workspaces, NCCL, ...)
    graph_reserve_bytes: int
    kv_bytes: int
    page_bytes: int
    num_pages: int
    is_capped_by_free: bool

    def describe(self) -> str:
        mib = 1 << 20
        capped = " (capped by the memory free at start)" if self.is_capped_by_free else ""
        return (
            f"KV pool {self.num_pages} pages x {self.page_bytes / mib:.2f} MiB = "
            f"{self.kv_bytes / mib:.0f} MiB: share {self.share_bytes / mib:.0f} MiB{capped} "
            f"of {self.total_bytes / mib:.0f} MiB x {self.utilization:g} - weights "
            f"{self.weights_bytes / mib:.0f} - activations {self.activation_bytes / mib:.0f} - "
            f"other {self.other_bytes / mib:.0f} - graphs {self.graph_reserve_bytes / mib:.0f} MiB"
        )


def plan_kv_pages(
    memory: DeviceMemory,
    utilization: float,
    weights_bytes: int,
    activation_bytes: int,
    other_bytes: int,
    graph_reserve_bytes: int,
    page_bytes: int,
) -> KVSizing:
    """The page count for ``memory`` (see the module docstring).

    Raises ValueError, with the breakdown, when not even one page fits.
    """
    if page_bytes <= 0:
        raise ValueError(f"page_bytes must be positive, got {page_bytes}")
    wanted = int(memory.total_bytes * utilization)
    share = min(wanted, memory.free_at_start_bytes)
    kv_bytes = share - weights_bytes - activation_bytes - max(other_bytes, 0) - graph_reserve_bytes
    num_pages = max(kv_bytes, 0) // page_bytes
    sizing = KVSizing(
        total_bytes=memory.total_bytes,
        utilization=utilization,
        share_bytes=share,
        weights_bytes=weights_bytes,
        activation_bytes=activation_bytes,
        other_bytes=max(other_bytes, 0),
        graph_reserve_bytes=graph_reserve_bytes,
        kv_bytes=num_pages * page_bytes,
        page_bytes=page_bytes,
        num_pages=num_pages,
        is_capped_by_free=share < wanted,
    )
    if num_pages < 1:
        raise ValueError(
            "no room for the KV cache: "
            + sizing.describe()
            + "; raise --gpu-memory-utilization, lower --max-prefill-tokens / --max-num-seqs, "
            "or free the device"
        )
    return sizing


def graph_reserve(enforce_eager: bool, configured: int | None) -> int:
    """Bytes held back for CUDA graphs: none when eager, else the configured figure or the
    default estimate."""
    if enforce_eager:
        return 0
    return DEFAULT_GRAPH_RESERVE_BYTES if configured is None else configured


def device_memory(device: torch.device) -> DeviceMemory:
    """Total and free memory of a CUDA ``device`` now (call before the worker allocates)."""
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total_bytes=total, free_at_start_bytes=free)


def sizing_lock_path(device: torch.device, lock_dir: Path | None = None) -> Path:
    """The lock file of one physical GPU, named by its UUID: two processes may know it by
    different indexes (CUDA_VISIBLE_DEVICES)."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    name = str(uuid) if uuid is not None else f"index-{device.index or 0}"
    return (lock_dir or Path(tempfile.gettempdir())) / f"pdserve-kv-sizing-{name}.lock"


@contextlib.contextmanager
def sizing_lock(device: torch.device, timeout_s: float = SIZING_LOCK_TIMEOUT_S) -> Iterator[None]:
    """Held by one worker of a GPU at a time while it measures memory and allocates its pool."""
    path = sizing_lock_path(device)
    logger.info("%s: waiting for the KV sizing lock %s", device, path)
    with exclusive_file_lock(path, timeout_s):
        yield


def measure_kv_sizing(
    device: torch.device,
    memory: DeviceMemory,
    weights_bytes: int,
    warm_up: Callable[[], None],
    utilization: float,
    graph_reserve_bytes: int,
    page_bytes: int,
) -> KVSizing:
    """Run ``warm_up`` (the largest forward and sampling pass the worker will make), measure its
    peak allocation and the non-torch memory since start, and plan the pool."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    warm_up()
    torch.cuda.synchronize(device)
    activation = torch.cuda.max_memory_allocated(device) - base
    free_now, _ = torch.cuda.mem_get_info(device)
    # Everything this process took since start, less what torch's allocator holds (weights,
    # cached activation blocks): CUDA libraries' workspaces and the like.
    other = (memory.free_at_start_bytes - free_now) - torch.cuda.memory_reserved(device)
    return plan_kv_pages(
        memory, utilization, weights_bytes, activation, other, graph_reserve_bytes, page_bytes
    )


def warm_up_sequences(
    max_prefill_tokens: int, max_model_len: int, max_num_seqs: int, page_size: int, num_pages: int
) -> tuple[list[Sequence], list[Sequence]]:
    """The largest step a worker will run, as scratch sequences: a prefill of
    ``max_prefill_tokens`` (as few sequences as ``max_model_len`` allows, on the first of
    ``num_pages`` pages) and a sampling pass of ``max_num_seqs`` rows with every sampling
    feature on (truncation, penalties, logprobs)."""
    seq_len = max(min(max_prefill_tokens, max_model_len), 1)
    num_seqs = min(-(-max_prefill_tokens // seq_len), max(max_num_seqs, 1))
    pages_each = -(-seq_len // page_size)
    num_seqs = max(min(num_seqs, num_pages // pages_each), 1)
    prefill = [
        Sequence(f"warm-up-{i}", [0] * seq_len, seq_len,
                 page_ids=list(range(i * pages_each, (i + 1) * pages_each)))
        for i in range(num_seqs)
    ]  # fmt: skip
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=0, logprobs=True,
                            top_logprobs=5, repetition_penalty=1.1)  # fmt: skip
    sampled = [Sequence(f"warm-up-s{i}", [0, 1], 1, params) for i in range(max(max_num_seqs, 1))]
    return prefill, sampled
