"""A Request is one generation stream inside an engine: its Sequence, its lifecycle state and
the mailbox its outputs are streamed through. Plain object; the engine (on the loop) is its writer.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.mailbox import OutputMailbox
from pdserve.engine.protocol import EngineError, KVTransferParams, ResumeState, TokenLogprob
from pdserve.sequence import Sequence

if TYPE_CHECKING:
    from pdserve.engine.output import OutputState

logger = logging.getLogger(__name__)


class RequestState(enum.StrEnum):
    WAITING = "waiting"  # queued for prefill (or for re-prefill after preemption)
    PREFILLING = "prefilling"  # pages allocated, prompt chunks being computed
    WAITING_FOR_KV = "waiting_for_kv"  # decode role: destination pages posted, KV not there yet
    PREFILL_INFLIGHT = "prefill_inflight"  # prefill role: prefill done, KV hand-off not final
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


# Allowed lifecycle moves; FINISHED is absorbing.
_NEXT: dict[RequestState, frozenset[RequestState]] = {
    RequestState.WAITING: frozenset(
        {
            RequestState.PREFILLING,  # its first chunk is scheduled
            RequestState.WAITING_FOR_KV,  # decode role: admitted, pages lent to a KV room
            RequestState.FINISHED,
        }
    ),
    RequestState.PREFILLING: frozenset(
        {RequestState.RUNNING, RequestState.PREFILL_INFLIGHT, RequestState.FINISHED}
    ),
    RequestState.WAITING_FOR_KV: frozenset({RequestState.RUNNING, RequestState.FINISHED}),
    RequestState.PREFILL_INFLIGHT: frozenset({RequestState.FINISHED}),
    RequestState.RUNNING: frozenset({RequestState.WAITING, RequestState.FINISHED}),
    RequestState.FINISHED: frozenset(),
}


@dataclass(eq=False)
class Request:
    request_id: str
    seq: Sequence
    kv_transfer: KVTransferParams | None = None
    priority: int = 0  # the priority policy runs lower values first (vLLM's meaning)
    state: RequestState = RequestState.WAITING
    arrival: float = field(default_factory=time.monotonic)
    state_entered: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    error: EngineError | None = None
    reason: str | None = None  # why the last move happened
    last_transition: tuple[str, str, str] | None = None  # (from, to, reason)
    deadline: asyncio.TimerHandle | None = None  # of the current state
    deadline_label: str | None = None  # what ``deadline`` reports when it fires
    overall_deadline: asyncio.TimerHandle | None = None
    pages_in_room: bool = False  # decode: pages lent to a KV room (the room frees them on failure)
    num_prefix_pages: int = 0  # decode: leading pages from its prefix cache, never lent to a room
    out_state: OutputState | None = None
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full pages
    num_cached_prompt_tokens: int | None = None  # prompt tokens its first prefill found cached
    prompt_logprobs: list[TokenLogprob | None] | None = None  # until the first delta takes them
    outputs: OutputMailbox = field(default_factory=OutputMailbox)
    # A migrated request: the tokens another worker streamed are already in its sequence.
    resume: ResumeState | None = None

    @property
    def room_id(self) -> str | None:
        return self.kv_transfer.room_id if self.kv_transfer else None

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def move(self, to: RequestState, reason: str) -> bool:
        """Lifecycle step; a move out of FINISHED (or any illegal move) is refused and logged."""
        if to not in _NEXT[self.state]:
            logger.debug(
                "req=%s refused move %s -> %s (%s)",
                self.request_id,
                self.state.value,
                to.value,
                reason,
            )
            return False
        logger.debug(
            "req=%s room=%s %s -> %s reason=%s",
            self.request_id, self.room_id, self.state.value, to.value, reason,
        )  # fmt: skip
        self.last_transition = (self.state.value, to.value, reason)
        self.state, self.reason, self.state_entered = to, reason, time.monotonic()
        return True

    def debug_dict(self, now: float) -> dict:
        return {
            "request_id": self.request_id,
            "state": self.state.value,
            "room_id": self.room_id,
            "age_s": round(now - self.arrival, 4),
            "in_state_s": round(now - self.state_entered, 4),
            "num_prompt_tokens": self.seq.num_prompt_tokens,
            "num_generated_tokens": self.seq.num_generated,
            "num_pages": len(self.seq.page_ids),
            "reason": self.reason,
            "last_transition": list(self.last_transition) if self.last_transition else None,
            "priority": self.priority,
            "deadline": self.deadline_label if self.deadline is not None else None,
            "deadline_in_s": _remaining(self.deadline),
            "overall_deadline_in_s": _remaining(self.overall_deadline),
        }


def _remaining(timer: asyncio.TimerHandle | None) -> float | None:
    # TimerHandle.when() is in loop time (monotonic on the default and uvloop loops).
    if timer is None or timer.cancelled():
        return None
    return round(timer.when() - asyncio.get_running_loop().time(), 4)
