"""KV transfer over NIXL: the agent wrapper (transport-core) and rooms on top (transport-rooms)."""

from __future__ import annotations

from pdserve.transport.nixl_agent import (
    KVAgent,
    KVAgentConfig,
    KVAgentStats,
    PoolDescriptor,
    TransferError,
)

__all__ = [
    "KVAgent",
    "KVAgentConfig",
    "KVAgentStats",
    "PoolDescriptor",
    "TransferError",
]

# transport-rooms: room logic on top of the agent (engines use these).
from pdserve.transport.config import TransportConfig  # noqa: E402
from pdserve.transport.faults import FaultPlan  # noqa: E402
from pdserve.transport.receiver import KVReceiver  # noqa: E402
from pdserve.transport.sender import KVSender  # noqa: E402

__all__ += ["FaultPlan", "KVReceiver", "KVSender", "TransportConfig"]
