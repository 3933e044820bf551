"""Plain counters of each side of the KV transport, read at scrape time (``stats``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SenderStats:
    """Plain counters of one sender (read at scrape time)."""

    rooms_opened: int = 0
    rooms_sent: int = 0  # rooms whose last chunk landed
    bytes_sent: int = 0
    chunks_sent: int = 0
    transfer_errors: int = 0
    kv_not_ready: int = 0  # rooms failed because their KV never became ready on the device
    peers_registered: int = 0
    peers_lost: int = 0
    aborts_sent: int = 0  # AbortNotifMsg sent to decode (both fenced and not)
    aborts_received: int = 0  # POST /abort
    acks_deferred: int = 0  # abort answered "not yet" because a write was outstanding
    duplicate_rejected: int = 0
    stale_rejected: int = 0
    late_rejected: int = 0  # dst posts for rooms that were already aborted (410)
    peak_writes_outstanding: int = 0  # high-water mark of concurrent write windows


@dataclass(slots=True)
class ReceiverStats:
    """Plain counters of one receiver (read at scrape time)."""

    rooms_opened: int = 0
    rooms_received: int = 0
    bytes_received: int = 0
    chunks_received: int = 0
    aborts_received: int = 0  # AbortNotifMsg from the sender
    stale_rejected: int = 0  # notifications from another sender incarnation than the room's
    late_notifs: int = 0  # notifications for rooms that already ended (or another nonce)
    bad_notifs: int = 0
    notifs_dropped: int = 0  # fault injection
    checksum_failures: int = 0
    bootstrap_errors: int = 0
    peers_lost: int = 0
    released_immediately: int = 0  # failed rooms whose pages the sender never had
