"""Engine configuration: role, scheduling budgets and request-level deadlines."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.scheduler import SchedulerConfig
from pdserve.spec.config import SpeculativeConfig

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class RequestDeadlines:
    """Seconds a request may spend in each non-terminal engine state (rooms have their own).

    Every request also has an overall deadline, whatever its state (``RUNNING``, and a
    preempted request queued again, included): ``request_s`` when given, else
    :meth:`overall_s`'s budget from its token count.
    """

    waiting_s: float = 60.0  # queued for a prefill slot
    # prefilling: renewed by every prefill step, so it fires only when prefill stops moving
    prefill_progress_s: float = 60.0
    waiting_for_kv_s: float = 120.0  # decode: backstop over the room's own deadlines
    prefill_inflight_s: float = 120.0  # prefill: backstop over the room's own deadlines
    request_s: float | None = None  # overall deadline; None: derived per request
    request_base_s: float = 60.0  # derived overall deadline: this ...
    request_per_token_s: float = 1.0  # ... plus this per token (prompt and max_tokens)

    def __post_init__(self) -> None:
        if self.request_s is not None and not self.request_s > 0:
            raise ValueError(f"the request deadline must be > 0 s, got {self.request_s}")
        if not (self.request_base_s >= 0 and self.request_per_token_s >= 0):
            raise ValueError(
                "the derived request deadline's base and per-token budget must be >= 0"
            )

    def overall_s(self, num_tokens: int) -> float:
        """The overall deadline of a request of ``num_tokens`` (prompt + max_tokens, capped at
        the model window): ``request_s``, else base + per-token budget x tokens."""
        if self.request_s is not None:
            return self.request_s
        return self.request_base_s + self.request_per_token_s * num_tokens


@dataclass(frozen=True)
class EngineConfig:
    role: str = "colocated"
    model_name: str = "pdserve-demo"
    engine_id: str = "engine-0"
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    deadlines: RequestDeadlines = field(default_factory=RequestDeadlines)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
