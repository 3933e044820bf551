"""The router's admission check: a 429 with ``Retry-After`` at once when no worker of the path a
request would take can take it soon, better than a prefill computing KV no decode can receive,
or a prompt joining a queue that grows without end.

Two roles are weighed: the workers that hold the KV for the whole generation (the decodes, or
the colocated workers, or the decodes alone on the fallback) by their queue and free KV pages
for prompt + output; and the workers that prefill the prompt (the prefills, or those same
workers) by their backlog of prompt tokens still to prefill (router/load.py).

A prompt's length (router/prompt_size.py): token ids are exact; a text gets bounds, and is
counted by a worker's ``POST /tokenize`` only when they do not decide or when prefill legs are
in flight (so a flood's prompts are counted into the backlog before the next probe shows it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdserve.router.config import RouterConfig
from pdserve.router.errors import error_response
from pdserve.router.legs import UpstreamClient
from pdserve.router.load import admission_refusal, backlog_refusal, output_budget
from pdserve.router.prompt_size import prompt_bounds, tokenize_request
from pdserve.router.stats import RouterStats
from pdserve.router.workers import Worker, WorkerManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AdmissionPath:
    """The workers a request would use: those holding its KV, and those prefilling it."""

    kv_holders: list[Worker]
    prefillers: list[Worker]


class Admission:
    """Decides, per request, between admitting it (with its prompt's size) and a 429."""

    def __init__(
        self,
        config: RouterConfig,
        workers: WorkerManager,
        upstream: UpstreamClient,
        stats: RouterStats,
    ) -> None:
        self._config = config
        self._workers = workers
        self._upstream = upstream
        self._stats = stats

    def path(self) -> AdmissionPath | None:
        """The roles the dispatcher would choose from now (None: no path, its 503)."""
        prefills = self._workers.available("prefill")
        decodes = self._workers.available("decode")
        if prefills and decodes:
            return AdmissionPath(decodes, prefills)
        colocated = self._workers.available("colocated")
        if colocated:
            return AdmissionPath(colocated, colocated)
        if decodes and not self._config.enforce_disagg:
            return AdmissionPath(decodes, decodes)  # a decode prefills the request itself
        return None

    async def check(self, body: dict[str, Any], request_id: str) -> tuple[int, web.Response | None]:
        """(the prompt's tokens as far as known, a 429 response or None to admit)."""
        path = self.path()
        bounds = prompt_bounds(body)
        if path is None:
            return bounds.low, None
        budget = output_budget(body)
        is_busy = any(w.num_in_flight or w.prefill_backlog() for w in path.prefillers)
        prompt = bounds.low
        if not bounds.is_exact:
            if not is_busy and self._refusal(path, budget, bounds.high, is_strict=True) is None:
                return prompt, None  # fits even at its largest: no need to count it
            if self._refusal(path, budget, bounds.low) is not None:
                return prompt, self._shed(path, budget, prompt, request_id)
            prompt = await self._count(path, body, bounds.low)
        return prompt, self._shed(path, budget, prompt, request_id)

    async def _count(self, path: AdmissionPath, body: dict[str, Any], low: int) -> int:
        ask = tokenize_request(body)
        if ask is None:
            return low
        worker = min(path.prefillers, key=lambda w: w.load_score())
        count = await self._upstream.count_tokens(worker, ask)
        return low if count is None else count  # no answer: never over-reject

    def _refusal(
        self, path: AdmissionPath, budget: int, prompt: int, *, is_strict: bool = False
    ) -> str | None:
        cfg = self._config
        loads = [w.load for w in path.kv_holders]
        reason = admission_refusal(
            loads, budget + prompt, cfg.max_worker_queue, is_strict=is_strict
        )
        if reason is not None:
            return reason
        backlogs = [w.prefill_backlog() for w in path.prefillers]
        limit = cfg.max_prefill_backlog_tokens
        reasons = [backlog_refusal(b, prompt, limit) for b in backlogs]
        return reasons[0] if reasons and all(reasons) else None

    def _shed(
        self, path: AdmissionPath, budget: int, prompt: int, request_id: str
    ) -> web.Response | None:
        infos = [w.info for w in path.kv_holders if w.info is not None]
        max_len = min((i.max_model_len for i in infos), default=None)
        if max_len is not None and budget + prompt > max_len:
            return None  # over the context window: the worker's 400 says so, not a 429
        reason = self._refusal(path, budget, prompt)
        if reason is None:
            return None
        self._stats.num_shed += 1
        logger.info("rid=%s: shed with 429, no worker can take it soon (%s)", request_id, reason)
        cfg = self._config
        headers = {"X-Request-Id": request_id, "Retry-After": str(cfg.retry_after_s)}
        message = f"router: every worker is at capacity ({reason}); retry later"
        return error_response(429, message, code="overloaded", headers=headers)
