"""The one import shim for NIXL: the CUDA variant that matches torch's CUDA.

The ``nixl`` meta package (our dependency) installs both ``nixl_cu12`` and ``nixl_cu13``; a
CUDA 13 torch needs ``nixl_cu13`` (and a CUDA 12 one ``nixl_cu12``) for VRAM transfers. We pick
the variant ourselves from ``torch.version.cuda``, as the meta package would, but import its
``_api`` directly: ``import nixl`` probes for CUDA at import time, which a CPU worker does not
need. With a CPU-only torch any installed variant drives host memory; plain ``nixl._api`` is the
last resort. ``pdserve.envs.quiet_nixl_logs()`` runs before the import so NIXL/UCX info chatter
stays off unless the user chose a level.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import torch

from pdserve.envs import quiet_nixl_logs

logger = logging.getLogger(__name__)

_VARIANTS = ("nixl_cu12", "nixl_cu13")


def nixl_module_order(torch_cuda: str | None) -> tuple[str, ...]:
    """NIXL ``_api`` modules to try, best first, for a torch built with CUDA ``torch_cuda``.

    ``"13.0"`` -> nixl_cu13 first, ``"12.8"`` -> nixl_cu12 first; None (CPU torch) -> the
    variants in a fixed order (either drives host memory). The other variant and the plain
    ``nixl`` package stay as fallbacks, so a worker still starts (DRAM works with any of them).
    """
    preferred: tuple[str, ...] = ()
    if torch_cuda:
        major = torch_cuda.split(".")[0]
        preferred = tuple(m for m in _VARIANTS if m == f"nixl_cu{major}")
    rest = tuple(m for m in _VARIANTS if m not in preferred)
    return (*preferred, *rest, "nixl")


def _import_api(torch_cuda: str | None) -> ModuleType:
    order = nixl_module_order(torch_cuda)
    errors: list[str] = []
    for name in order:
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        if torch_cuda and name != order[0]:
            logger.warning(
                "torch is built for CUDA %s but %s is not importable; using %s (VRAM transfers "
                "may fail)", torch_cuda, order[0], name,
            )  # fmt: skip
        return api
    raise ImportError("no NIXL Python API found: " + "; ".join(errors))


quiet_nixl_logs()
_api = _import_api(torch.version.cuda)
nixl_agent = _api.nixl_agent
nixl_agent_config = _api.nixl_agent_config
nixl_thread_sync_t = _api.nixl_thread_sync_t

__all__ = ["nixl_agent", "nixl_agent_config", "nixl_module_order", "nixl_thread_sync_t"]
