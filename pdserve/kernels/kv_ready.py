"""Readiness of KV writes: has the forward that wrote some pages finished on its device?

On CUDA a forward is queued on a stream and returns before its kernels ran; a NIXL WRITE (or a
page handed to another writer) is not ordered with that stream, so it must wait until the
forward's kernels are done. The runner records a marker after each forward
(:func:`record_kv_ready`): a ``torch.cuda.Event`` on the current stream on CUDA, the always-complete
:data:`ALWAYS_READY` on the CPU, where ops are done when they return. Consumers only ever ask
``query()`` (never block a thread on it) and poll with a deadline (:func:`wait_kv_ready`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

# The first polls are quick (a forward usually ends within a millisecond of its host-side
# return), then they back off to this: a wait costs at most ~1 ms of extra latency.
_FIRST_POLL_S = 0.00005
_MAX_POLL_S = 0.001


@runtime_checkable
class KVReady(Protocol):
    """A completion marker: ``query()`` is True once the writes before it are done."""

    def query(self) -> bool: ...


class _AlwaysReady:
    """The marker of host-synchronous work (CPU): complete from the start."""

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "ALWAYS_READY"


ALWAYS_READY: KVReady = _AlwaysReady()


def record_kv_ready(device: torch.device) -> KVReady:
    """A marker after everything queued so far on ``device``'s current stream."""
    if device.type != "cuda":
        return ALWAYS_READY
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


async def wait_kv_ready(
    marker: KVReady, timeout_s: float, should_stop: Callable[[], bool] = lambda: False
) -> bool:
    """Poll ``marker`` on the event loop (never blocking it): True once it completed; False if
    ``timeout_s`` passed first or ``should_stop()`` became true (the waiter gave up)."""
    if marker.query():
        return True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    poll_s = _FIRST_POLL_S
    while not marker.query():
        if should_stop() or loop.time() >= deadline:
            return False
        await asyncio.sleep(poll_s)  # polling a device event, with a deadline: not a sync sleep
        poll_s = min(poll_s * 2, _MAX_POLL_S)
    return True
