"""Engine configuration: role, scheduling budgets and request-level deadlines."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.scheduler import SchedulerConfig

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class RequestDeadlines:
    """Seconds a request may spend in each non-terminal engine state (rooms have their own)."""

    waiting_s: float = 60.0  # queued for a prefill slot
    waiting_for_kv_s: float = 120.0  # decode: backstop over the room's own deadlines
    prefill_inflight_s: float = 120.0  # prefill: backstop over the room's own deadlines
    request_s: float | None = None  # optional overall deadline


@dataclass(frozen=True)
class EngineConfig:
    role: str = "colocated"
    model_name: str = "pdserve-demo"
    engine_id: str = "engine-0"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    deadlines: RequestDeadlines = field(default_factory=RequestDeadlines)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
