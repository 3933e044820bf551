"""Plain counters of a room table, read by the metrics layer at scrape time (no prometheus here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GONE = "Gone"  # the "state" under which triggers for unknown or finished room ids are counted


def reason_key(reason: str) -> str:
    """Low-cardinality label for a failure reason.

    ``"transfer_error: UCX ..."`` -> ``"transfer_error"``; ``"timeout:Transferring"`` stays whole
    because which state timed out is the useful part.
    """
    if reason.startswith("timeout:"):
        return reason.split(None, 1)[0]
    return reason.split(":", 1)[0].strip()


@dataclass(slots=True)
class RoomStats:
    """Monotonic counters of one :class:`~pdserve.fsm.table.RoomTable` (single writer: the loop)."""

    created: int = 0
    succeeded: int = 0
    failed: int = 0
    transitions: int = 0  # accepted triggers, internal chunk_sent included
    release_errors: int = 0  # on_release callbacks that raised (logged, not propagated)
    failed_by_reason: dict[str, int] = field(default_factory=dict)
    rejected: dict[tuple[str, str], int] = field(default_factory=dict)  # (trigger, state)
    timeouts_by_state: dict[str, int] = field(default_factory=dict)

    @property
    def num_rejected(self) -> int:
        """All triggers that were counted no-ops."""
        return sum(self.rejected.values())

    def as_dict(self) -> dict[str, Any]:
        """JSON-able copy (rejected keys become ``"trigger@state"``)."""
        return {
            "created": self.created,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "transitions": self.transitions,
            "release_errors": self.release_errors,
            "failed_by_reason": dict(self.failed_by_reason),
            "rejected": {f"{t}@{s}": n for (t, s), n in self.rejected.items()},
            "timeouts_by_state": dict(self.timeouts_by_state),
        }
