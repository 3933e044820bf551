"""The dtype a model runs in: ``auto`` takes the checkpoint's own, an explicit name wins.

The one place where a ``--dtype`` / ``RunnerConfig.dtype`` name becomes a torch dtype.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Names of torch dtypes; torch is imported only to resolve one, so that the command-line flags
# (the router's too) can offer the choices without loading torch.
DTYPE_NAMES = ("bfloat16", "float32", "float16")
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
# Spellings found in config.json files ("torch_dtype" or, from transformers 5, "dtype").
_ALIASES = {"bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32",
            "fp32": "float32"}  # fmt: skip


class UnsupportedDtypeError(ValueError):
    """A dtype name pdserve does not know, or one the device cannot run."""


# Fallback of ``auto`` when the checkpoint says nothing pdserve can run.
AUTO_FALLBACK = "bfloat16"


def checkpoint_dtype_name(value: object) -> str | None:
    """The dtype a checkpoint declares, as one of DTYPE_NAMES; None if absent or unknown."""
    if not isinstance(value, str):
        return None
    name = value.removeprefix("torch.").lower()
    name = _ALIASES.get(name, name)
    return name if name in DTYPE_NAMES else None


def resolve_dtype(
    name: str, device: torch.device, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """Map a dtype name (or ``auto``: the checkpoint's ``checkpoint_dtype``) to torch.

    float16 is CUDA only (CPU half matmuls are very slow): asked for explicitly on a CPU it is an
    error; a float16 checkpoint under ``auto`` runs in bfloat16 there (its range holds every
    float16 value; its precision is coarser).
    """
    if name == "auto":
        return _torch_dtype(_auto_name(checkpoint_dtype, device))
    if name not in DTYPE_NAMES:
        raise UnsupportedDtypeError(
            f"unsupported dtype {name!r}; choose one of {list(DTYPE_CHOICES)}"
        )
    if name == "float16" and device.type == "cpu":
        raise UnsupportedDtypeError(
            "float16 is only supported on CUDA; use bfloat16 or float32 on CPU"
        )
    declared = checkpoint_dtype_name(checkpoint_dtype)
    if declared is not None and declared != name:
        logger.info("dtype %s given: the %s checkpoint is converted on load", name, declared)
    return _torch_dtype(name)


def _auto_name(checkpoint_dtype: str | None, device: torch.device) -> str:
    declared = checkpoint_dtype_name(checkpoint_dtype)
    if declared is None:
        logger.warning(
            "dtype auto: the checkpoint declares no dtype pdserve runs (%r); using %s",
            checkpoint_dtype, AUTO_FALLBACK,
        )  # fmt: skip
        return AUTO_FALLBACK
    if declared == "float16" and device.type == "cpu":
        logger.warning("dtype auto: a float16 checkpoint runs in bfloat16 on CPU (no fast fp16)")
        return "bfloat16"
    logger.info("dtype auto: %s, as the checkpoint declares", declared)
    return declared


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


KV_CACHE_DTYPE_CHOICES = ("auto", "bfloat16", "float32")


def resolve_kv_cache_dtype(
    name: str, weight_dtype: torch.dtype, act_dtype: torch.dtype
) -> torch.dtype:
    """The KV cache's dtype: ``auto`` is the weights' (bf16 for a bf16 checkpoint: K/V are
    computed in the activations' float32 on CPUs and rounded once, when stored); an explicit
    ``bfloat16`` / ``float32`` wins where the attention kernels read it: a pool dtype other than
    the activations' needs float32 activations (every CPU run; ``--dtype float32`` on CUDA,
    where every backend rounds the new K/V to the pool's dtype as it stores them)."""
    import torch

    if name not in KV_CACHE_DTYPE_CHOICES:
        raise UnsupportedDtypeError(
            f"unsupported kv_cache_dtype {name!r}; choose one of {list(KV_CACHE_DTYPE_CHOICES)}"
        )
    dtype = weight_dtype if name == "auto" else _torch_dtype(name)
    if dtype != act_dtype and act_dtype != torch.float32:
        raise UnsupportedDtypeError(
            f"kv_cache_dtype {name} needs {act_dtype} activations to match it on this device"
        )
    return dtype
