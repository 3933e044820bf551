"""KV readiness markers: host work is ready at once; a device marker is polled with a deadline."""

from __future__ import annotations

import torch

from pdserve.kernels.kv_ready import ALWAYS_READY, KVReady, record_kv_ready, wait_kv_ready


class _Later:
    """Completes after ``n`` queries."""

    def __init__(self, n: int) -> None:
        self.left = n

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0


def test_host_work_is_ready_when_recorded() -> None:
    marker = record_kv_ready(torch.device("cpu"))
    assert marker is ALWAYS_READY and marker.query() and isinstance(marker, KVReady)


async def test_wait_returns_once_the_marker_completes() -> None:
    assert await wait_kv_ready(_Later(5), timeout_s=5.0)


async def test_wait_gives_up_at_its_deadline_or_when_told_to_stop() -> None:
    assert not await wait_kv_ready(_Later(10**9), timeout_s=0.05)
    assert not await wait_kv_ready(_Later(10**9), timeout_s=5.0, should_stop=lambda: True)
