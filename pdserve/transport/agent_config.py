"""Configuration, counters and errors of one KV agent, and the loop/thread settling helpers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any


class TransferError(RuntimeError):
    """A NIXL operation towards a peer failed, or cannot be attempted (unknown peer, closed)."""


@dataclass(frozen=True, slots=True)
class KVAgentConfig:
    """Knobs of one agent. The defaults are what bench/transfer.py found best on CPU hosts."""

    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = 0  # UCX backend worker threads (0: NIXL default)
    # "none" lets UCX use shared memory for a write's completion and notification: ~10 us per
    # room, and a write completes without waiting for the receiver to poll. "peer" (NIXL's
    # default) excludes shm, so both go over tcp loopback and each write waits ~1 receiver
    # poll period. A killed peer still fails writes in both modes (bench/transfer.py, docs).
    ucx_error_handling_mode: str = "none"
    merge_descs: bool = True  # let NIXL merge runs contiguous on both sides (bench lever only)
    # Polling tiers. A wait ends early when the loop queues a command, so these bound only how
    # late a transfer's completion or an incoming notification is seen. In a VM each timed
    # wake-up costs ~20 us of CPU (and GIL hand-offs slow the loop): 50 us polling burns ~40%
    # of a core, which on a 2-core host made rooms slower, not faster (docs/benchmarks.md).
    busy_wait_s: float = 0.00005  # transfers outstanding (PROC): tight
    hot_wait_s: float = 0.0002  # activity within hot_window_s (a burst of rooms)
    hot_window_s: float = 0.01
    idle_wait_s: float = 0.001  # activity within warm_window_s, or hold_warm() holds
    warm_window_s: float = 0.05
    # Nothing outstanding or expected: a stray notification (a late abort) waits <= 50 ms. At
    # 5 ms, a decode worker's agent woke ~500 times a second during decoding, preempting the
    # step's threads: decode steps were ~10% slower than colocated ones (docs/benchmarks.md).
    cold_wait_s: float = 0.05
    start_timeout_s: float = 30.0  # agent creation takes ~0.5 s (UCX init)
    op_timeout_s: float = 10.0  # add_peer / remove_peer / send_notif
    write_timeout_s: float = 60.0  # safety net; room deadlines normally fire first
    close_timeout_s: float = 5.0  # how long close() lets in-flight writes finish


@dataclass(slots=True)
class KVAgentStats:
    """Plain counters, read by the metrics module at scrape time."""

    num_writes: int = 0
    num_write_errors: int = 0
    num_bytes_written: int = 0
    num_notifs_sent: int = 0
    num_notifs_received: int = 0
    num_peers_added: int = 0
    num_peers_removed: int = 0


def settle(fut: asyncio.Future[Any], result: Any, err: BaseException | None) -> None:
    """Resolve ``fut`` (on the loop) unless it is already done (cancelled by its waiter)."""
    if fut.done():
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(result)


def as_transfer_error(e: object) -> TransferError:
    """A NIXL exception or a transfer state other than DONE, as a :class:`TransferError`."""
    if isinstance(e, TransferError):
        return e
    if isinstance(e, BaseException):
        return TransferError(f"{type(e).__name__}: {e}")
    return TransferError(f"transfer state {e}")
