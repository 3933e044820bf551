"""Speculation's counters, read by the metrics module at scrape time (all 0 until a verify)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """``drafts``: sequences that drafted at least one token in a verify step; per position
    ``j`` (0-based): drafts that reached ``j`` and those whose token ``j`` was accepted."""

    num_positions: int
    verify_steps: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    verify_seconds: float = 0.0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.drafted_per_pos = [0] * self.num_positions
        self.accepted_per_pos = [0] * self.num_positions

    def record(self, num_drafted: int, num_emitted: int) -> None:
        """One sequence of a verify step: ``num_drafted`` drafts, ``num_emitted`` tokens out
        (the accepted drafts and the target's next token)."""
        accepted = max(num_emitted - 1, 0)
        self.emitted_tokens += num_emitted
        if not num_drafted:
            return
        self.drafts += 1
        self.draft_tokens += num_drafted
        self.accepted_tokens += accepted
        for j in range(min(num_drafted, self.num_positions)):
            self.drafted_per_pos[j] += 1
            self.accepted_per_pos[j] += j < accepted

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafts per sequence that drafted (0 before any)."""
        return self.accepted_tokens / self.drafts if self.drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "verify_steps": self.verify_steps, "drafts": self.drafts,
            "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
            "emitted_tokens": self.emitted_tokens, "verify_seconds": self.verify_seconds,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_per_pos": list(self.accepted_per_pos),
            "drafted_per_pos": list(self.drafted_per_pos),
        }  # fmt: skip
