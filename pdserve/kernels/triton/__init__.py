"""Triton attention kernels that read the KV page pool in place (the GPU attention backend).

Importing :mod:`.decode` or :mod:`.extend` needs ``triton``; on a CPU the kernels run only under
Triton's interpreter (``TRITON_INTERPRET=1``, read by triton when a kernel is decorated, so it
must be set before those modules are first imported). :func:`is_available` says whether they
can run on a device without importing them.
"""

from __future__ import annotations

import importlib.util

import torch

from pdserve import envs


def is_available(device: torch.device) -> bool:
    """Triton is installed and can run kernels on ``device`` (CUDA, or the interpreter on CPU)."""
    if importlib.util.find_spec("triton") is None:
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and envs.triton_interpreter_enabled()
