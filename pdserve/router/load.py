"""What a worker reports of its load (``/server_info`` -> ``load``), and the router's use of it:
a score to balance by and the admission checks that answer 429 at once when no worker of the
path's KV-holding role can take a request soon (queue, KV pages), or no worker of its
prefilling role can (its backlog of prompt tokens to prefill).

A report is as old as the last health probe (``--health-interval``); the router adds its own
in-flight counts (requests, and prompt tokens on prefill legs), which are current, so a burst
between two probes still spreads, and a flood is refused before the next probe shows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.router.prompt_size import num_prompts


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One worker's reported load, validated (missing counters read 0)."""

    num_requests: int = 0
    waiting: int = 0  # queued for prefill (or re-prefill after preemption)
    prefilling: int = 0  # prompt being prefilled
    waiting_for_kv: int = 0  # decode: pages lent to a room, KV not there yet
    running: int = 0
    waiting_prompt_tokens: int = 0  # prompt tokens queued for prefill (its backlog)
    free_pages: int | None = None  # None: not reported (then pages never block admission)
    total_pages: int | None = None
    page_size: int | None = None
    draining: bool = False

    @classmethod
    def from_json(cls, raw: Any) -> WorkerLoad | None:
        """Parse ``server_info.load``; None when absent. ValueError if malformed."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError("server_info.load is not a JSON object")
        ints: dict[str, int | None] = {}
        names = (
            "num_requests",
            "waiting",
            "prefilling",
            "waiting_for_kv",
            "running",
            "waiting_prompt_tokens",
            "free_pages",
            "total_pages",
        )
        for name in names:
            value = raw.get(name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"server_info.load.{name} invalid: {value!r}")
            ints[name] = value
        page_size = raw.get("page_size")
        if page_size is not None and (type(page_size) is not int or page_size <= 0):
            raise ValueError(f"server_info.load.page_size invalid: {page_size!r}")
        return cls(
            num_requests=ints["num_requests"] or 0,
            waiting=ints["waiting"] or 0,
            prefilling=ints["prefilling"] or 0,
            waiting_for_kv=ints["waiting_for_kv"] or 0,
            running=ints["running"] or 0,
            waiting_prompt_tokens=ints["waiting_prompt_tokens"] or 0,
            free_pages=ints["free_pages"],
            total_pages=ints["total_pages"],
            page_size=page_size,
            draining=raw.get("draining") is True,
        )

    @property
    def queued(self) -> int:
        """Requests admitted but not yet decoding."""
        return self.waiting + self.prefilling + self.waiting_for_kv


def load_score(num_in_flight: int, load: WorkerLoad | None) -> tuple[int, int]:
    """Lower is less loaded: the larger of the router's own in-flight count and the worker's
    reported requests (another router's traffic shows only there), then fewer free pages."""
    if load is None:
        return (num_in_flight, 0)
    free = load.free_pages if load.free_pages is not None else 0
    return (max(num_in_flight, load.num_requests), -free)


def output_budget(body: dict[str, Any]) -> int:
    """The output tokens a request may generate (0 when it does not say): its limit under
    any of the three names (chat, completions, responses), once per prompt of a batch."""
    budget = body.get("max_completion_tokens", body.get("max_tokens"))
    if budget is None:
        budget = body.get("max_output_tokens")
    return budget * num_prompts(body) if type(budget) is int and budget > 0 else 0


def refusal(
    load: WorkerLoad | None, tokens: int, max_queue: int, *, is_strict: bool = False
) -> str | None:
    """Why a worker cannot take a request of ``tokens`` soon, or None if it can. A request
    that can never fit is the worker's to refuse (a 400 naming the field), unless
    ``is_strict``: then it is refused here too (a check with an upper bound on ``tokens``)."""
    if load is None:
        return None
    if load.draining:
        return "draining"
    if load.queued >= max_queue:
        return f"{load.queued} requests queued (limit {max_queue})"
    if load.free_pages is not None and load.page_size:
        pages = -(-tokens // load.page_size)
        fits_at_all = is_strict or load.total_pages is None or pages <= load.total_pages
        if pages > load.free_pages and fits_at_all:
            return f"{pages} KV pages needed, {load.free_pages} free"
    return None


def backlog_refusal(backlog: int, prompt_tokens: int, max_backlog: int) -> str | None:
    """Why a prefilling worker with ``backlog`` prompt tokens still to prefill cannot take a
    prompt of ``prompt_tokens`` soon, or None. An idle one takes any prompt."""
    if backlog > 0 and backlog + prompt_tokens > max_backlog:
        return f"{backlog} prompt tokens queued for prefill (limit {max_backlog})"
    return None


def admission_refusal(
    loads: Sequence[WorkerLoad | None], tokens: int, max_queue: int, *, is_strict: bool = False
) -> str | None:
    """None if any worker can take the request soon, else why the first one cannot (all
    refused: the router answers 429 with Retry-After instead of computing KV nobody can take)."""
    reasons = [refusal(load, tokens, max_queue, is_strict=is_strict) for load in loads]
    if not reasons or any(r is None for r in reasons):
        return None
    return reasons[0]
