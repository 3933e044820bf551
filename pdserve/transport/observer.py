"""Hooks the transport calls as KV moves; the metrics module implements them (Prometheus).

The transport never imports the metrics: a server passes an observer down. The defaults do
nothing, so tests and benches need none.
"""

from __future__ import annotations


class TransferObserver:
    """Per-room transfer observations of a :class:`~pdserve.transport.sender.KVSender`."""

    def on_room_sent(self, seconds: float, num_bytes: int) -> None:
        """A room's KV landed: ``seconds`` from its first WRITE posted to its last one done."""

    def on_kv_ready_wait(self, seconds: float) -> None:
        """How long a room's WRITE waited for its prefill's KV writes to finish on the device."""
