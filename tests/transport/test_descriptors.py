"""Pool descriptors: host vs GPU memory, the device from the tensor itself, page rows."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdserve.kernels.kv_cache import KVCacheConfig
from pdserve.transport.descriptors import (
    PoolDescriptor,
    cuda_device_of,
    mem_type_of,
    page_indices,
)

KV = KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, num_pages=8, page_size=16)


@dataclass
class FakeTensor:
    """The slice of torch.Tensor a descriptor reads, on a chosen device (no GPU needed)."""

    device_index: int  # -1: host memory, as torch's get_device() says for CPU tensors
    base: int = 0x7F0000000000

    @property
    def is_cuda(self) -> bool:
        return self.device_index >= 0

    def get_device(self) -> int:
        return self.device_index

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return self.base

    @property
    def shape(self) -> tuple[int, ...]:
        return (KV.num_pages, KV.num_layers, 2, KV.page_size, KV.num_kv_heads, KV.head_dim)


@dataclass
class FakePool:
    kv: FakeTensor
    config: KVCacheConfig = KV

    @property
    def page_bytes(self) -> int:
        return KV.page_bytes


def test_a_gpu_pool_is_vram_on_the_tensors_own_device() -> None:
    desc = PoolDescriptor.of_pool(FakePool(FakeTensor(3)))  # type: ignore[arg-type]
    assert (desc.mem_type, desc.device_id) == ("VRAM", 3)
    assert desc.page_descs()[:, 2].tolist() == [3] * KV.num_pages
    assert desc.num_pages == KV.num_pages and desc.page_bytes == KV.page_bytes


def test_a_host_pool_is_dram_on_device_zero() -> None:
    host = FakeTensor(-1)
    assert cuda_device_of(host) is None and mem_type_of(host) == "DRAM"
    desc = PoolDescriptor.of_pool(FakePool(host))  # type: ignore[arg-type]
    assert (desc.mem_type, desc.device_id) == ("DRAM", 0)


def test_page_rows_address_each_page_and_round_trip_as_json() -> None:
    desc = PoolDescriptor(base_address=4096, page_bytes=256, num_pages=4, device_id=1)
    rows = desc.page_descs()
    assert rows[:, 0].tolist() == [4096, 4352, 4608, 4864] and set(rows[:, 1]) == {256}
    assert PoolDescriptor.from_json(desc.to_json()) == desc
    with pytest.raises(ValueError):
        PoolDescriptor.from_json({**desc.to_json(), "mem_type": "DISK"})


def test_page_indices_are_bounds_checked() -> None:
    assert page_indices([0, 3], 4, "src").tolist() == [0, 3]
    with pytest.raises(ValueError, match="src"):
        page_indices([4], 4, "src")
