"""VRAM KV over NIXL (runs where a CUDA device is present): pages move GPU to GPU, and a WRITE
waits for the stream that wrote them (here a deliberately delayed side stream)."""

from __future__ import annotations

import pytest
import torch

from pdserve.fsm import RoomState
from pdserve.kernels.kv_cache import KVCacheConfig, KVPagePool
from pdserve.kernels.kv_ready import record_kv_ready
from tests.transport.conftest import KV, Endpoints, outcome

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LOCAL = "127.0.0.1"
DELAY_CYCLES = 400_000_000  # ~0.2 s of GPU time before the side stream writes the pages


def vram_pool() -> KVPagePool:
    return KVPagePool(KVCacheConfig(num_pages=32, **KV), device="cuda")


async def test_vram_pools_are_described_as_vram_on_their_device(endpoints: Endpoints) -> None:
    sender, _ = await endpoints.sender(pool=vram_pool())
    desc = sender.agent.descriptor
    assert desc.mem_type == "VRAM" and desc.device_id == sender.pool.kv.get_device()


async def test_a_write_waits_for_the_stream_that_wrote_the_pages(endpoints: Endpoints) -> None:
    sender, _ = await endpoints.sender(pool=vram_pool())
    receiver, _ = await endpoints.receiver(pool=vram_pool())
    src, dst = [1, 2, 3], [7, 8, 9]
    idx = torch.tensor(src, device="cuda")
    data = torch.randn((len(src), *sender.pool.kv.shape[1:]), device="cuda")
    data = data.to(sender.pool.kv.dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(DELAY_CYCLES)  # the "forward" is still running when send() is called
        sender.pool.kv.index_copy_(0, idx, data)
        kv_ready = record_kv_ready(torch.device("cuda"))
    sender.open_room("v", "req")
    room = await receiver.open_room("v", "req", LOCAL, sender.bootstrap_port, dst, 40)
    assert sender.send("v", src, 40, first_token=1, kv_ready=kv_ready)
    assert (await outcome(room, within_s=30.0)).state == RoomState.SUCCESS
    torch.cuda.synchronize()
    got = receiver.pool.kv[torch.tensor(dst, device="cuda")]
    assert torch.equal(got, data)
