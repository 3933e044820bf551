"""In-process fixtures for the transport-rooms tests: real KVSender/KVReceiver, real NIXL agents."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest_asyncio
import torch

from pdserve.fsm import Room, RoomDeadlines, RoomOutcome
from pdserve.kernels.kv_cache import KVCacheConfig, KVPagePool
from pdserve.transport.config import TransportConfig
from pdserve.transport.observer import TransferObserver
from pdserve.transport.receiver import KVReceiver
from pdserve.transport.sender import KVSender

KV = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=16)  # 4 KiB bf16 pages
FAST = RoomDeadlines(bootstrapping_s=2.0, waiting_for_input_s=2.0, transferring_s=2.0)
HB = 0.2  # heartbeat interval used by these tests


def make_pool(num_pages: int = 64) -> KVPagePool:
    return KVPagePool(KVCacheConfig(num_pages=num_pages, **KV))


def make_config(engine_id: str, **overrides: Any) -> TransportConfig:
    kwargs: dict[str, Any] = dict(
        bootstrap_port=0,
        heartbeat_interval_s=HB,
        abort_quarantine_s=0.5,
        connect_timeout_s=0.5,
        request_timeout_s=1.0,
        deadlines=FAST,
    )
    kwargs.update(overrides)
    return TransportConfig(engine_id, **kwargs)


def fill(pool: KVPagePool, pages: list[int], seed: int) -> None:
    """Seeded random content in ``pages`` (so a transfer has something to prove)."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn((len(pages), *pool.kv.shape[1:]), generator=gen)
    pool.kv[torch.tensor(pages, dtype=torch.long)] = data.to(pool.kv.dtype)


def pages_equal(a: KVPagePool, a_pages: list[int], b: KVPagePool, b_pages: list[int]) -> bool:
    ia, ib = torch.tensor(a_pages, dtype=torch.long), torch.tensor(b_pages, dtype=torch.long)
    return torch.equal(a.kv[ia], b.kv[ib])


class Releases:
    """Records on_release callbacks, and lets a test wait for one."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int], float]] = []
        self._changed = asyncio.Event()

    def __call__(self, room_id: str, pages: list[int]) -> None:
        self.calls.append((room_id, list(pages), asyncio.get_running_loop().time()))
        self._changed.set()

    def of(self, room_id: str) -> list[list[int]]:
        return [pages for rid, pages, _ in self.calls if rid == room_id]

    async def wait(self, room_id: str, within_s: float = 5.0) -> list[int]:
        await until(lambda: bool(self.of(room_id)), within_s, f"release of {room_id}")
        return self.of(room_id)[0]


async def until(pred: Callable[[], bool], within_s: float = 5.0, what: str = "condition") -> None:
    """Poll ``pred`` until true, failing after ``within_s`` (no fixed sleeps as sync)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"{what} not reached within {within_s}s")
        await asyncio.sleep(0.005)


async def outcome(room: Room, within_s: float = 5.0) -> RoomOutcome:
    """The room's outcome (shielded: other waiters keep theirs)."""
    return await asyncio.wait_for(asyncio.shield(room.done), within_s)


class Endpoints:
    """Factory of started senders/receivers, all stopped at teardown."""

    def __init__(self) -> None:
        self.started: list[KVSender | KVReceiver] = []

    async def sender(
        self,
        engine_id: str = "prefill-0",
        observer: TransferObserver | None = None,
        pool: KVPagePool | None = None,
        **cfg: Any,
    ) -> tuple[KVSender, Releases]:
        rel = Releases()
        sender = KVSender(make_config(engine_id, **cfg), pool or make_pool(), rel, observer)
        await sender.start()
        self.started.append(sender)
        return sender, rel

    async def receiver(
        self, engine_id: str = "decode-0", pool: KVPagePool | None = None, **cfg: Any
    ) -> tuple[KVReceiver, Releases]:
        rel = Releases()
        receiver = KVReceiver(make_config(engine_id, **cfg), pool or make_pool(), rel)
        await receiver.start()
        self.started.append(receiver)
        return receiver, rel

    async def stop(self, endpoint: KVSender | KVReceiver) -> None:
        if endpoint in self.started:
            self.started.remove(endpoint)
            await endpoint.stop()


@pytest_asyncio.fixture
async def endpoints() -> AsyncIterator[Endpoints]:
    eps = Endpoints()
    yield eps
    for endpoint in reversed(eps.started):
        await endpoint.stop()
