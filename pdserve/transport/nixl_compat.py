"""The one import shim for NIXL.

``pdserve.envs.quiet_nixl_logs()`` runs before the import so NIXL/UCX info chatter stays off
unless the user chose a level. ``nixl_cu12._api`` is imported directly: the ``nixl`` meta package
imports torch and probes CUDA at import time, which a CPU worker does not need. Plain ``nixl._api``
is the fallback for a non-CUDA-variant install.
"""

from __future__ import annotations

from pdserve.envs import quiet_nixl_logs

quiet_nixl_logs()

try:
    from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError:  # pragma: no cover - depends on which wheel is installed
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t  # type: ignore

__all__ = ["nixl_agent", "nixl_agent_config", "nixl_thread_sync_t"]
