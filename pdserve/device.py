"""Which device a worker computes on, as configuration: parsing, validation and the flags.

A device is ``cpu``, ``cuda`` (the current CUDA device) or ``cuda:N``. It is checked once, when
the configuration is read (a flag, or :class:`~pdserve.model_runner.RunnerConfig` through the
Python API), so that a wrong value fails with a message naming where it came from instead of
deep inside torch. The CPU-only machinery (thread calibration, the CPU lease, float32 weight
copies, the C++ kernels) asks :func:`is_cpu` rather than comparing strings.

torch is imported inside the functions: the command line (the router's too) imports this
module for its flags, and the router never needs torch.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # as vLLM's --gpu-memory-utilization


def check_device(value: str, source: str = "device") -> torch.device:
    """``value`` as a torch device, or ValueError naming ``source`` (a flag or a field).

    CUDA devices must exist here: ``cuda`` needs a visible GPU, ``cuda:N`` needs N < count.
    """
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"{source}={value!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        if device.index not in (None, 0):
            raise ValueError(f"{source}={value!r}: expected cpu, cuda or cuda:N")
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"{source}={value!r}: expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(
            f"{source}={value!r}: CUDA is not available on this machine "
            "(torch.cuda.is_available() is False); use cpu"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"{source}={value!r}: this machine has {count} CUDA device(s)")
    return device


def check_gpu_memory_utilization(value: float, source: str = "gpu_memory_utilization") -> float:
    """A fraction in (0, 1], or ValueError naming ``source``."""
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{source}={value!r}: must be a fraction in (0, 1]")
    return value


def bind_device(device: str | torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing to do elsewhere).

    CUDA's current device is per host thread, and Triton launches, graph capture and streams
    or events made without a device all use it: a worker on ``cuda:1`` whose step thread
    never set it would run them on device 0. Cheap enough to call at every step.
    """
    import torch

    device = torch.device(device)
    is_indexed_cuda = device.type == "cuda" and device.index is not None
    if is_indexed_cuda and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)


# The CPU's spellings, answered without importing torch: the launcher checks its devices and
# starts workers, and would hold torch's ~250 MB for nothing.
_CPU_NAMES = ("cpu", "cpu:0")


def is_cpu(device: str | torch.device) -> bool:
    if isinstance(device, str) and device in _CPU_NAMES:
        return True
    import torch

    return torch.device(device).type == "cpu"


def same_physical_device(a: str, b: str) -> bool:
    """True when two device strings name one device (``cuda`` is the current one, ``cuda:0``
    in a fresh process unless CUDA_VISIBLE_DEVICES reorders them)."""
    if a in _CPU_NAMES and b in _CPU_NAMES:
        return True
    import torch

    da, db = torch.device(a), torch.device(b)
    if da.type != db.type:
        return False
    return da.type == "cpu" or (da.index or 0) == (db.index or 0)


def device_arg(value: str) -> str:
    """argparse ``type`` of a device flag: the checked device as a string."""
    if value in _CPU_NAMES:
        return "cpu"
    try:
        return str(check_device(value, "value"))
    except ValueError as e:  # argparse prefixes the flag's name: "argument --device: ..."
        raise argparse.ArgumentTypeError(str(e).removeprefix("value=")) from None


def _utilization_arg(value: str) -> float:
    try:
        return check_gpu_memory_utilization(float(value), "value")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("value=")) from None


def add_device_args(p: argparse.ArgumentParser, utilization_default: float | None) -> None:
    """``--device``, ``--gpu-memory-utilization`` and ``--enforce-eager``.

    ``utilization_default`` None leaves the choice to the caller (``pdserve up`` splits one GPU
    between its two workers).
    """
    p.add_argument(
        "--device", type=device_arg, default="cpu", metavar="{cpu,cuda,cuda:N}",
        help="where the model runs (default cpu)",
    )  # fmt: skip
    p.add_argument(
        "--gpu-memory-utilization", type=_utilization_arg, default=utilization_default,
        metavar="FRACTION",
        help="CUDA: the fraction of the device's total memory this worker may use for weights, "
        "activations, CUDA graphs and the KV cache, which gets the rest "
        f"(default {DEFAULT_GPU_MEMORY_UTILIZATION}; pdserve up on one GPU: half that each)",
    )  # fmt: skip
    p.add_argument(
        "--num-gpu-blocks", type=int, default=None, metavar="N",
        help="KV pages of the pool, overriding --kv-cache-mb and the CUDA memory sizing",
    )  # fmt: skip
    p.add_argument(
        "--enforce-eager", action="store_true",
        help="CUDA: run decode steps eagerly, never through captured CUDA graphs",
    )  # fmt: skip
