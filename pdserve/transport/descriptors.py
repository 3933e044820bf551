"""What a peer needs to address our KV pages, and where they live (host DRAM or GPU VRAM).

Descriptors cross the wire as JSON (:meth:`PoolDescriptor.to_json`), never NIXL's pickled
descriptor lists. A CUDA pool is described by the tensor's own device (``tensor.get_device()``:
``torch.device("cuda").index`` is None for the current device, which would describe GPU 0 on
every rank). With tensor parallelism later, each rank's process owns one pool and one
descriptor; nothing here assumes a single GPU per host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from pdserve.kernels.kv_cache import KVPagePool

MEM_TYPES = ("DRAM", "VRAM")


class _DeviceTensor(Protocol):
    """The part of ``torch.Tensor`` the descriptor reads (fakes in tests implement it)."""

    @property
    def is_cuda(self) -> bool: ...

    def get_device(self) -> int: ...


def cuda_device_of(tensor: _DeviceTensor) -> int | None:
    """The CUDA ordinal a tensor lives on, or None for host memory."""
    return tensor.get_device() if tensor.is_cuda else None


def mem_type_of(tensor: _DeviceTensor) -> str:
    """NIXL memory type of a tensor's storage: ``"VRAM"`` on a GPU, else ``"DRAM"``."""
    return "VRAM" if tensor.is_cuda else "DRAM"


@dataclass(frozen=True, slots=True)
class PoolDescriptor:
    """What a peer needs to address our pages: page ``i`` is at ``base + i * page_bytes``."""

    base_address: int
    page_bytes: int
    num_pages: int
    device_id: int = 0
    mem_type: str = "DRAM"

    def __post_init__(self) -> None:
        for field_name in ("base_address", "page_bytes", "num_pages", "device_id"):
            v = getattr(self, field_name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"PoolDescriptor.{field_name} must be an int >= 0, got {v!r}")
        if self.page_bytes == 0 or self.num_pages == 0:
            raise ValueError("PoolDescriptor needs page_bytes > 0 and num_pages > 0")
        if self.mem_type not in MEM_TYPES:
            raise ValueError(f"PoolDescriptor.mem_type must be one of {MEM_TYPES}")

    @classmethod
    def of_pool(cls, pool: KVPagePool) -> PoolDescriptor:
        """The descriptor of a local page pool (its one contiguous, page-major tensor)."""
        kv = pool.kv
        if not kv.is_contiguous():
            raise ValueError("the KV pool tensor must be contiguous")
        return cls(
            base_address=kv.data_ptr(),
            page_bytes=pool.page_bytes,
            num_pages=kv.shape[0],
            device_id=cuda_device_of(kv) or 0,
            mem_type=mem_type_of(kv),
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (orjson-ready)."""
        return {
            "base_address": self.base_address,
            "page_bytes": self.page_bytes,
            "num_pages": self.num_pages,
            "device_id": self.device_id,
            "mem_type": self.mem_type,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PoolDescriptor:
        """Validate a dict made by :meth:`to_json` (raises ``ValueError`` on anything else)."""
        if not isinstance(d, dict):
            raise ValueError("PoolDescriptor JSON must be an object")
        try:
            return cls(
                **{k: d[k] for k in ("base_address", "page_bytes", "num_pages")},
                device_id=d.get("device_id", 0),
                mem_type=d.get("mem_type", "DRAM"),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"bad PoolDescriptor JSON: {e}") from None

    def page_descs(self) -> np.ndarray:
        """One NIXL descriptor per page, ``(num_pages, 3)`` uint64 rows (address, length, dev)."""
        out = np.empty((self.num_pages, 3), dtype=np.uint64)
        out[:, 0] = self.base_address + np.arange(self.num_pages, dtype=np.uint64) * np.uint64(
            self.page_bytes
        )
        out[:, 1] = self.page_bytes
        out[:, 2] = self.device_id
        return out


def page_indices(pages: Sequence[int] | np.ndarray, num_pages: int, what: str) -> np.ndarray:
    """Page ids as the int32 index array NIXL takes, bounds-checked (vectorized)."""
    idx = np.asarray(pages, dtype=np.int64).reshape(-1)
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= num_pages):
        raise ValueError(f"{what} out of range [0, {num_pages})")
    return idx.astype(np.int32)
