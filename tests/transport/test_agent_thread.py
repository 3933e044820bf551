"""The agent thread makes the pool's GPU current before NIXL sees its memory."""

from __future__ import annotations

import threading

import pytest

from pdserve.transport import agent_thread
from pdserve.transport.agent_config import KVAgentConfig
from pdserve.transport.agent_thread import AgentThread, bind_cuda_device
from pdserve.transport.descriptors import PoolDescriptor
from tests.transport.test_descriptors import FakePool, FakeTensor


def test_a_vram_pool_binds_its_own_device_on_the_calling_thread() -> None:
    calls: list[int] = []
    assert bind_cuda_device(FakeTensor(2), calls.append) == 2
    assert calls == [2]


def test_a_host_pool_leaves_the_cuda_device_alone() -> None:
    calls: list[int] = []
    assert bind_cuda_device(FakeTensor(-1), calls.append) is None
    assert calls == []


class FakeNixl:
    """Stands in for nixl_agent: records each call with the thread that made it."""

    calls: list[tuple[str, str]] = []

    def __init__(self, name: str, config: object) -> None:
        self._record("create")

    def _record(self, what: str) -> None:
        FakeNixl.calls.append((what, threading.current_thread().name))

    def create_backend(self, backend: str, params: dict[str, str]) -> None:
        self._record("create_backend")

    def register_memory(self, tensor: object) -> object:
        self._record("register_memory")
        return object()

    def prep_xfer_dlist(self, *args: object) -> object:
        return None

    def get_agent_metadata(self) -> bytes:
        return b"meta"

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}

    def deregister_memory(self, reg: object) -> None:
        self._record("deregister_memory")


def test_the_device_is_set_on_the_agent_thread_before_registration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FakeNixl.calls = []
    monkeypatch.setattr(agent_thread, "nixl_agent", FakeNixl)
    monkeypatch.setattr(
        agent_thread.torch.cuda,
        "set_device",
        lambda d: FakeNixl.calls.append((f"set_device:{d}", threading.current_thread().name)),
    )
    pool = FakePool(FakeTensor(1))
    desc = PoolDescriptor.of_pool(pool)  # type: ignore[arg-type]
    thread = AgentThread(
        "a",
        pool,
        desc,
        KVAgentConfig(),
        lambda *_: None,
        lambda _n: None,  # type: ignore[arg-type]
    )
    exited = threading.Event()
    thread.start(on_exit=exited.set)
    thread.submit(thread.request_stop, lambda _e: None)
    assert exited.wait(10.0)
    names = [what for what, _ in FakeNixl.calls]
    assert names.index("set_device:1") < names.index("create") < names.index("register_memory")
    assert {who for _, who in FakeNixl.calls} == {"kv-agent-a"}  # all on the agent thread
    assert thread.metadata == b"meta" and "deregister_memory" in names
