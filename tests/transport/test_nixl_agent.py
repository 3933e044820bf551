"""KVAgent over real NIXL (UCX): two agents in this process, plus one test across processes."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest
import pytest_asyncio
import torch

from pdserve.envs import env_with_pythonpath
from pdserve.kernels.kv_cache import KVCacheConfig, KVPagePool
from pdserve.transport.nixl_agent import KVAgent, KVAgentConfig, PoolDescriptor, TransferError

REPO = Path(__file__).resolve().parents[2]
KV = KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, num_pages=64, page_size=16)
WAIT_S = 10.0  # every wait on the agent thread or a peer is bounded by this


@dataclass
class Inbox:
    """Collects notifications (on the loop) and lets a test wait for a given count."""

    items: list[tuple[str, bytes]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    check: Callable[[], bool] | None = None  # run at each arrival, results in ``checked``
    checked: list[bool] = field(default_factory=list)

    def __call__(self, name: str, msg: bytes) -> None:
        if self.check is not None:
            self.checked.append(self.check())
        self.items.append((name, msg))
        self.changed.set()

    async def wait_for(self, count: int) -> list[tuple[str, bytes]]:
        async with asyncio.timeout(WAIT_S):
            while len(self.items) < count:
                self.changed.clear()
                await self.changed.wait()
        return self.items


async def until(pred: Callable[[], bool], what: str) -> None:
    """Poll ``pred`` with a deadline (the loop keeps running the agent's hand-offs)."""
    deadline = time.monotonic() + WAIT_S
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {WAIT_S}s")
        await asyncio.sleep(0.001)


@dataclass
class Pair:
    a: KVAgent
    b: KVAgent
    inbox_b: Inbox


def make_pool(seed: int | None = None) -> KVPagePool:
    pool = KVPagePool(KV)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(pool.kv.dtype))
    return pool


def started(
    name: str, pool: KVPagePool, inbox: Inbox | None = None, config: KVAgentConfig | None = None
) -> KVAgent:
    agent = KVAgent(name, pool, asyncio.get_running_loop(), inbox or Inbox(), config)
    agent.start()
    return agent


def pages_equal(a: KVPagePool, src: list[int], b: KVPagePool, dst: list[int]) -> bool:
    return torch.equal(a.kv[torch.tensor(src)], b.kv[torch.tensor(dst)])


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[Pair]:
    inbox_b = Inbox()
    a = started("tcore-a", make_pool(seed=1))
    b = started("tcore-b", make_pool(), inbox_b)
    await a.add_peer(b.name, b.metadata, b.descriptor)
    yield Pair(a, b, inbox_b)
    await a.close()
    await b.close()


# -- PoolDescriptor -------------------------------------------------------------------------------


def test_pool_descriptor_round_trips_through_json() -> None:
    pool = make_pool()
    desc = PoolDescriptor.of_pool(pool)
    assert desc.base_address == pool.base_address
    assert desc.page_bytes == KV.page_bytes and desc.num_pages == KV.num_pages
    assert PoolDescriptor.from_json(orjson.loads(orjson.dumps(desc.to_json()))) == desc
    descs = desc.page_descs()
    assert descs.shape == (KV.num_pages, 3)
    assert int(descs[5, 0]) == pool.page_address(5) and int(descs[5, 1]) == KV.page_bytes


@pytest.mark.parametrize(
    "bad",
    [
        {"base_address": -1, "page_bytes": 4096, "num_pages": 1},
        {"base_address": 1, "page_bytes": 0, "num_pages": 1},
        {"base_address": 1, "page_bytes": "4096", "num_pages": 1},
        {"base_address": 1, "page_bytes": 4096, "num_pages": True},
        {"base_address": 1, "page_bytes": 4096, "num_pages": 1, "mem_type": "FILE"},
        {"page_bytes": 4096, "num_pages": 1},
        [1, 2, 3],
    ],
)
def test_pool_descriptor_rejects_malformed_json(bad: object) -> None:
    with pytest.raises(ValueError):
        PoolDescriptor.from_json(bad)  # type: ignore[arg-type]


# -- data path ------------------------------------------------------------------------------------


async def test_write_contiguous_pages_lands_exact_bytes(pair: Pair) -> None:
    src, dst = list(range(0, 16)), list(range(32, 48))
    await pair.a.write(pair.b.name, src, dst, b"contiguous")
    assert pages_equal(pair.a.pool, src, pair.b.pool, dst)
    assert pair.b.pool.kv[:32].abs().sum() == 0  # nothing outside dst was touched
    assert pair.a.stats.num_bytes_written == 16 * KV.page_bytes


async def test_write_scattered_and_partly_coalescable_pages_lands_exact_bytes(pair: Pair) -> None:
    # runs [3,4,5]->[10,11,12] coalesce; the rest are single, in shuffled order
    src = [3, 4, 5, 40, 7, 63, 0, 21]
    dst = [10, 11, 12, 2, 50, 0, 63, 30]
    await pair.a.write(pair.b.name, src, dst, b"scattered")
    assert pages_equal(pair.a.pool, src, pair.b.pool, dst)
    untouched = sorted(set(range(KV.num_pages)) - set(dst))
    assert pair.b.pool.kv[torch.tensor(untouched)].abs().sum() == 0


async def test_notification_arrives_with_exact_payload_after_the_data(pair: Pair) -> None:
    src, dst = [1, 2, 9], [5, 6, 7]
    payload = orjson.dumps({"room": "r-1", "chunk": 0, "last": True, "tok": 42})
    pair.inbox_b.check = lambda: pages_equal(pair.a.pool, src, pair.b.pool, dst)
    await pair.a.write(pair.b.name, src, dst, payload)
    items = await pair.inbox_b.wait_for(1)
    assert items == [(pair.a.name, payload)]
    assert pair.inbox_b.checked == [True]  # the data was there when the notification ran


async def test_many_writes_in_flight_all_land_and_notify(pair: Pair) -> None:
    num_writes = 32
    writes = [
        pair.a.write(pair.b.name, [i, 63 - i], [2 * i, 2 * i + 1], b"w%d" % i)
        for i in range(num_writes)
    ]
    tasks = [asyncio.create_task(w) for w in writes]
    await asyncio.sleep(0)  # let every task submit before checking the count
    assert pair.a.num_outstanding == num_writes
    async with asyncio.timeout(WAIT_S):
        await asyncio.gather(*tasks)
    assert pair.a.num_outstanding == 0 and pair.a.outstanding_for(pair.b.name) == 0
    for i in range(num_writes):
        assert pages_equal(pair.a.pool, [i, 63 - i], pair.b.pool, [2 * i, 2 * i + 1])
    items = await pair.inbox_b.wait_for(num_writes)
    assert sorted(msg for _, msg in items) == sorted(b"w%d" % i for i in range(num_writes))


async def test_cancelled_write_stays_counted_until_nixl_finishes_it(pair: Pair) -> None:
    task = asyncio.create_task(pair.a.write(pair.b.name, [8], [9], b"cancelled"))
    await asyncio.sleep(0)  # submitted to the agent thread
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await pair.inbox_b.wait_for(1)  # the transfer went ahead regardless
    await until(lambda: pair.a.outstanding_for(pair.b.name) == 0, "outstanding drained")
    assert pair.a.stats.num_writes == 1
    assert pages_equal(pair.a.pool, [8], pair.b.pool, [9])


async def test_write_rejects_bad_page_lists(pair: Pair) -> None:
    with pytest.raises(ValueError):
        await pair.a.write(pair.b.name, [0, 1], [0], b"")
    with pytest.raises(ValueError):
        await pair.a.write(pair.b.name, [], [], b"")
    with pytest.raises(ValueError):
        await pair.a.write(pair.b.name, [KV.num_pages], [0], b"")
    with pytest.raises(ValueError):
        await pair.a.write(pair.b.name, [0], [-1], b"")
    assert pair.a.num_outstanding == 0


async def test_send_notif_delivers_control_message(pair: Pair) -> None:
    await pair.a.send_notif(pair.b.name, b'{"abort":"r-9"}')
    assert await pair.inbox_b.wait_for(1) == [(pair.a.name, b'{"abort":"r-9"}')]
    with pytest.raises(TransferError):
        await pair.a.send_notif("nobody", b"x")


# -- peers ----------------------------------------------------------------------------------------


async def test_write_to_unknown_or_removed_peer_raises_transfer_error(pair: Pair) -> None:
    with pytest.raises(TransferError):
        await pair.a.write("nobody", [0], [0], b"x")
    await pair.a.remove_peer(pair.b.name)
    assert not pair.a.has_peer(pair.b.name)
    with pytest.raises(TransferError):
        await pair.a.write(pair.b.name, [0], [0], b"x")
    await pair.a.remove_peer(pair.b.name)  # idempotent


async def test_restarted_peer_with_new_name_works_after_remove(pair: Pair) -> None:
    await pair.a.write(pair.b.name, [0], [0], b"before")
    await pair.a.remove_peer(pair.b.name)
    await pair.b.close()
    inbox = Inbox()
    b2 = started("tcore-b-2", make_pool(), inbox)  # a new incarnation: new agent name
    try:
        await pair.a.add_peer(b2.name, b2.metadata, b2.descriptor)
        await pair.a.write(b2.name, [4, 5], [6, 7], b"after")
        assert pages_equal(pair.a.pool, [4, 5], b2.pool, [6, 7])
        assert await inbox.wait_for(1) == [(pair.a.name, b"after")]
    finally:
        await b2.close()


async def test_add_peer_checks_name_and_is_idempotent(pair: Pair) -> None:
    b = pair.b
    await pair.a.add_peer(b.name, b.metadata, b.descriptor)  # same again: no-op
    other = PoolDescriptor(b.descriptor.base_address, b.descriptor.page_bytes, 8)
    with pytest.raises(ValueError):
        await pair.a.add_peer(b.name, b.metadata, other)
    with pytest.raises(TransferError):  # metadata of tcore-b under another name
        await pair.a.add_peer("impostor", b.metadata, b.descriptor)
    assert not pair.a.has_peer("impostor") and pair.a.peers() == [b.name]


# -- lifecycle ------------------------------------------------------------------------------------


async def test_close_with_writes_in_flight_settles_every_write(pair: Pair) -> None:
    tasks = [
        asyncio.create_task(pair.a.write(pair.b.name, [i], [i], b"c%d" % i)) for i in range(16)
    ]
    await asyncio.sleep(0)
    async with asyncio.timeout(WAIT_S):
        await pair.a.close()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(r is None or isinstance(r, TransferError) for r in results), results
    assert pair.a.num_outstanding == 0
    assert pair.a._thread is not None and not pair.a._thread.is_alive()
    with pytest.raises(TransferError):
        await pair.a.write(pair.b.name, [0], [0], b"late")
    await pair.a.close()  # idempotent


async def test_failed_start_raises_transfer_error_and_close_returns() -> None:
    agent = KVAgent(
        "tcore-bad", make_pool(), asyncio.get_running_loop(), Inbox(),
        KVAgentConfig(backends=("NO_SUCH_BACKEND",)),
    )  # fmt: skip
    with pytest.raises(TransferError):
        agent.start()
    with pytest.raises(TransferError):
        await agent.write("anyone", [0], [0], b"x")
    async with asyncio.timeout(WAIT_S):
        await agent.close()


async def test_idle_pair_of_agents_uses_under_5_percent_of_a_core() -> None:
    cfg = KVAgentConfig(warm_window_s=0.1)  # reach the idle (cold) polling tier quickly
    inbox = Inbox()
    a = started("tcore-idle-a", make_pool(seed=3), config=cfg)
    b = started("tcore-idle-b", make_pool(), inbox, config=cfg)
    try:
        await a.add_peer(b.name, b.metadata, b.descriptor)
        await a.write(b.name, [0], [0], b"warm")  # connected, then idle
        await inbox.wait_for(1)
        await asyncio.sleep(2 * cfg.warm_window_s)  # time passing is the point: go idle

        # CPU of the pair's threads and of this (the loop's) thread: other tests' agents or
        # other processes on the machine do not count
        def cpu_s() -> float:
            return a.thread_cpu_s() + b.thread_cpu_s() + time.thread_time()

        cpu0, wall0 = cpu_s(), time.perf_counter()
        await asyncio.sleep(1.0)  # the measured idle window, not a synchronisation
        cpu, wall = cpu_s() - cpu0, time.perf_counter() - wall0
        assert a.thread_cpu_s() > 0 and b.thread_cpu_s() > 0  # both threads really measured
        assert cpu / wall < 0.05, f"idle pair used {100 * cpu / wall:.1f}% of a core"
    finally:
        await a.close()
        await b.close()


# -- across processes ------------------------------------------------------------------------------

# The receiving child: prints its agent's metadata and descriptor as one JSON line, then waits for
# a notification naming the pages written, and prints their sha256.
CHILD = """
import asyncio, base64, hashlib, sys, orjson, torch
from pdserve.kernels.kv_cache import KVCacheConfig, KVPagePool
from pdserve.transport.nixl_agent import KVAgent

async def main():
    pool = KVPagePool(KVCacheConfig(**orjson.loads(sys.argv[1])))
    got = asyncio.get_running_loop().create_future()
    agent = KVAgent("tcore-child", pool, asyncio.get_running_loop(),
                    lambda name, msg: got.done() or got.set_result((name, msg)))
    agent.start()
    print(orjson.dumps({"metadata": base64.b64encode(agent.metadata).decode(),
                        "descriptor": agent.descriptor.to_json()}).decode(), flush=True)
    name, msg = await asyncio.wait_for(got, 30)
    pages = torch.tensor(orjson.loads(msg)["pages"])
    digest = hashlib.sha256(pool.kv[pages].contiguous().view(torch.uint8).numpy()).hexdigest()
    print(orjson.dumps({"from": name, "sha256": digest}).decode(), flush=True)
    await agent.close()

asyncio.run(main())
"""


def sha256_of(pool: KVPagePool, pages: list[int]) -> str:
    data = pool.kv[torch.tensor(pages)].contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(data).hexdigest()


async def read_json_line(stream: asyncio.StreamReader) -> dict:
    async with asyncio.timeout(60):  # the child imports torch on a loaded machine
        line = await stream.readline()
    assert line, "child exited early"
    return orjson.loads(line)


@pytest.mark.slow
async def test_child_process_receives_pages_with_matching_checksum() -> None:
    kv_args = {k: getattr(KV, k) for k in ("num_layers", "num_kv_heads", "head_dim", "num_pages")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, orjson.dumps(kv_args).decode(),
        stdout=asyncio.subprocess.PIPE,
        env=env_with_pythonpath(str(REPO)),
    )  # fmt: skip
    assert proc.stdout is not None
    sender = started("tcore-parent", make_pool(seed=7))
    try:
        hello = await read_json_line(proc.stdout)
        desc = PoolDescriptor.from_json(hello["descriptor"])
        await sender.add_peer("tcore-child", base64.b64decode(hello["metadata"]), desc)
        src, dst = [0, 1, 2, 3, 17, 18, 40, 63], [60, 61, 62, 63, 5, 6, 30, 0]
        await sender.write("tcore-child", src, dst, orjson.dumps({"pages": dst}))
        report = await read_json_line(proc.stdout)
        assert report == {"from": "tcore-parent", "sha256": sha256_of(sender.pool, src)}
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
        # the receiver is gone: a write to it fails on the sending side, it does not hang
        with pytest.raises(TransferError):
            await sender.write("tcore-child", [0], [0], b"to the dead")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await sender.close()


async def test_agent_polls_every_millisecond_while_held_warm_and_rarely_when_idle() -> None:
    # Each timed wake-up of an idle agent preempts a model thread: with nothing outstanding
    # and nothing expected it waits cold_wait_s; a receiver's hold keeps it at idle_wait_s.
    cfg = KVAgentConfig(warm_window_s=0.05)
    agent = started("tcore-holds", make_pool(), config=cfg)
    try:

        async def polls_in(window_s: float) -> int:
            before = agent.debug_dict()["polls"]
            await asyncio.sleep(window_s)  # the measured window, not a synchronisation
            return agent.debug_dict()["polls"] - before

        await asyncio.sleep(2 * cfg.warm_window_s)  # time passing is the point: go idle
        idle = await polls_in(0.5)
        agent.hold_warm()
        agent.hold_warm()
        agent.release_warm()  # one hold left
        assert agent.debug_dict()["warm_holds"] == 1
        held = await polls_in(0.5)
        agent.release_warm()
        assert agent.debug_dict()["warm_holds"] == 0
        await asyncio.sleep(2 * cfg.warm_window_s)
        idle_again = await polls_in(0.5)
    finally:
        await agent.close()
    assert idle <= 0.5 / cfg.cold_wait_s + 2, f"idle agent polled {idle} times in 0.5 s"
    assert held >= 100, f"held agent polled only {held} times in 0.5 s (1 ms period)"
    assert idle_again <= 0.5 / cfg.cold_wait_s + 2
