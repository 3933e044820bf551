"""Fault injection for the KV transport: delays, dropped notifications, failed transfers, lost peer.

A :class:`FaultPlan` is a frozen description (part of ``TransportConfig``); each sender or receiver
builds its own :class:`FaultInjector` from it, which owns the seeded RNG and counts what it
injected. The transport consults the injector at fixed points, so a plan means the same thing in
tests and in chaos benchmarks:

- ``delay_s``: the sender waits this long before each chunk write, *inside* the write window
  (the room counts as having a write outstanding), which widens the mid-transfer window.
- ``fail_transfer_prob``: the sender replaces a chunk write by a :class:`TransferError`, handled
  exactly like a real NIXL failure (rooms of that peer fail ``transfer_error``, peer forgotten).
- ``drop_notif_prob``: the receiver discards an incoming data notification (the data landed but
  the "data is there" signal is lost), so the room can only end by deadline or abort.
- ``drop_peer_after_n``: after ``n`` successful rooms with a peer, that side declares the peer
  lost (rooms fail ``peer_lost``, metadata forgotten), exercising the re-register path.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FaultPlan:
    """What to inject; all off by default. ``seed`` makes a run reproducible."""

    delay_s: float = 0.0
    drop_notif_prob: float = 0.0
    fail_transfer_prob: float = 0.0
    drop_peer_after_n: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("drop_notif_prob", "fail_transfer_prob"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {value}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")
        if self.drop_peer_after_n is not None and self.drop_peer_after_n < 1:
            raise ValueError(f"drop_peer_after_n must be >= 1, got {self.drop_peer_after_n}")

    def injector(self) -> FaultInjector:
        """A fresh injector (own RNG and counters) for one sender or receiver."""
        return FaultInjector(self)


@dataclass
class FaultStats:
    """Plain counters of injected faults, read by stats()."""

    delays: int = 0
    notifs_dropped: int = 0
    transfers_failed: int = 0
    peers_dropped: int = 0


@dataclass
class FaultInjector:
    """Decides, at each injection point, whether to inject. Owned by one loop (single writer)."""

    plan: FaultPlan
    stats: FaultStats = field(default_factory=FaultStats)
    _rng: random.Random = field(init=False, repr=False)
    _successes: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.plan.seed)

    def chunk_delay_s(self) -> float:
        """Seconds to wait before a chunk write (0.0 when no delay is planned)."""
        if self.plan.delay_s <= 0:
            return 0.0
        self.stats.delays += 1
        return self.plan.delay_s

    def should_fail_transfer(self) -> bool:
        """True if this chunk write must fail as if NIXL had raised."""
        if self.plan.fail_transfer_prob <= 0 or self._rng.random() >= self.plan.fail_transfer_prob:
            return False
        self.stats.transfers_failed += 1
        return True

    def should_drop_notif(self) -> bool:
        """True if this incoming data notification must be discarded."""
        if self.plan.drop_notif_prob <= 0 or self._rng.random() >= self.plan.drop_notif_prob:
            return False
        self.stats.notifs_dropped += 1
        return True

    def should_drop_peer(self, peer: str) -> bool:
        """Record one successful room with ``peer``; True when the planned count is reached."""
        if self.plan.drop_peer_after_n is None:
            return False
        count = self._successes.get(peer, 0) + 1
        self._successes[peer] = count
        if count < self.plan.drop_peer_after_n:
            return False
        self._successes.pop(peer, None)
        self.stats.peers_dropped += 1
        return True


def maybe_injector(plan: FaultPlan | None) -> FaultInjector | None:
    """The injector for ``plan``, or None when no faults are planned."""
    return plan.injector() if plan is not None else None
