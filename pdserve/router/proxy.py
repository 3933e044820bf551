"""PD dispatch: the retry loop around :class:`Attempt`, path choice, and the answer to give
when every attempt failed before the first byte."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from pdserve.auth import ANONYMOUS
from pdserve.router.admission import Admission
from pdserve.router.attempt import Attempt, end_broken_stream
from pdserve.router.attempt_types import (
    AttemptEnv,
    AttemptFailed,
    ClientGone,
    Plan,
    Spawn,
    StreamBroken,
    build_leg_bodies,
)
from pdserve.router.cache_aware import CacheAwareConfig, routing_text
from pdserve.router.client_stream import ClientStream
from pdserve.router.config import WORKER_ROLES, RouterConfig
from pdserve.router.errors import error_response
from pdserve.router.legs import UpstreamClient
from pdserve.router.migration import StreamTracker, first_body, is_migratable
from pdserve.router.policies import make_policy
from pdserve.router.scoring import needs_prompt_logits
from pdserve.router.stats import RouterStats
from pdserve.router.workers import Worker, WorkerManager

logger = logging.getLogger(__name__)

__all__ = ["Dispatcher", "backoff_s", "build_leg_bodies"]


@dataclass(eq=False)
class RequestCtx:
    request_id: str
    path: str
    body: dict[str, Any]
    raw_body: bytes
    started: float
    attempt: Attempt | None = None  # the current one
    is_aborted: bool = False
    outcome: str = "499"  # stats label; stays 499 if the client leaves
    tracker: StreamTracker | None = None  # a stream that may migrate (migration on)
    owner: str = ANONYMOUS  # the tag of the client key that started it (pdserve/auth.py)
    client: ClientStream | None = None  # keep-alive comments until the first data chunk

    def attempt_body(self) -> tuple[dict[str, Any], bytes]:
        """The body of the next attempt: the client's, or a migrated stream's continuation."""
        tracker = self.tracker
        if tracker is None:
            return self.body, self.raw_body
        body = first_body(self.body) if tracker.out is None else tracker.resume_body(self.body)
        return body, orjson.dumps(body)


class Dispatcher:
    """Serves client requests over the workers, retrying before the first byte."""

    def __init__(
        self,
        config: RouterConfig,
        workers: WorkerManager,
        upstream: UpstreamClient,
        stats: RouterStats,
        rng: random.Random,
        spawn: Spawn,
    ) -> None:
        self._config = config
        self._workers = workers
        self._stats = stats
        self._rng = rng
        self._env = AttemptEnv(config, upstream, stats, spawn)
        self._admission = Admission(config, workers, upstream, stats)
        cache_aware = CacheAwareConfig(
            cache_threshold=config.cache_threshold,
            balance_abs=config.balance_abs_threshold,
            balance_rel=config.balance_rel_threshold,
        )

        def num_prefills() -> int:
            return len(workers.available("prefill"))

        self._policies = {
            role: make_policy(config.policy, rng, cache_aware, num_prefills)
            for role in WORKER_ROLES
        }
        self._active: dict[str, RequestCtx] = {}
        self._idle = asyncio.Event()  # set while no request is active (a drain waits on it)
        self._idle.set()

    @property
    def num_active(self) -> int:
        """Requests being served now."""
        return len(self._active)

    async def wait_idle(self) -> None:
        """Return once no request is being served."""
        await self._idle.wait()

    def is_active(self, request_id: str) -> bool:
        return request_id in self._active

    def owner_of(self, request_id: str) -> str | None:
        """The owner tag of a request in flight; None if none is."""
        ctx = self._active.get(request_id)
        return ctx.owner if ctx is not None else None

    def debug_requests(self) -> list[dict[str, Any]]:
        """Every request the router is serving now: id, age, current attempt and its legs."""
        now = time.monotonic()
        out = []
        for ctx in self._active.values():
            attempt = ctx.attempt
            legs = attempt.legs if attempt is not None else []
            out.append(
                {
                    "request_id": ctx.request_id,
                    "path": ctx.path,
                    "age_s": round(now - ctx.started, 3),
                    "attempt_request_id": attempt.request_id if attempt else None,
                    "room_id": attempt.room_id if attempt else None,
                    "is_aborted": ctx.is_aborted,
                    "legs": [
                        {"worker": leg.worker.url, "role": leg.worker.role, "outcome": leg.outcome}
                        for leg in legs
                    ],
                }
            )
        return out

    def abort(self, request_id: str) -> bool:
        """Forward an abort to the current legs of a request; it will not be retried."""
        ctx = self._active.get(request_id)
        if ctx is None:
            return False
        ctx.is_aborted = True
        logger.info("rid=%s: abort requested, forwarding to its legs", request_id)
        if ctx.attempt is not None:
            ctx.attempt.abort_legs()
        return True

    async def handle(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        raw_body: bytes,
        request_id: str,
        owner: str = ANONYMOUS,
    ) -> web.StreamResponse:
        """Serve one OpenAI request end to end (the caller checked auth and parsed the body)."""
        ctx = RequestCtx(request_id, path, body, raw_body, time.monotonic(), owner=owner)
        if self._config.migration_limit > 0 and is_migratable(path, body):
            ctx.tracker = StreamTracker(
                is_chat=path.endswith("/chat/completions"),
                keep_token_ids=body.get("return_token_ids") is True,
            )
        self._active[request_id] = ctx
        self._idle.clear()
        try:
            return await self._run(request, ctx)
        except ClientGone as gone:
            self._count_disconnect(ctx, f"write failed: {gone}")
            return gone.response
        except asyncio.CancelledError:
            delivered = ctx.attempt.delivered_status if ctx.attempt is not None else None
            if delivered is not None:  # it hung up after [DONE]: nothing was abandoned
                ctx.outcome = str(delivered)
                logger.debug("rid=%s: client closed after [DONE]", request_id)
            else:
                self._count_disconnect(ctx, "connection lost")
            raise
        finally:
            if ctx.client is not None:
                await ctx.client.take()  # no comment after the end
            del self._active[request_id]
            if not self._active:
                self._idle.set()
            self._stats.requests_by_status[ctx.outcome] += 1
            self._stats.latency.observe(time.monotonic() - ctx.started)
            logger.debug("rid=%s: request ended, outcome=%s", request_id, ctx.outcome)

    def _count_disconnect(self, ctx: RequestCtx, why: str) -> None:
        ctx.outcome = "499"
        self._stats.num_client_disconnects += 1
        logger.info("rid=%s: client disconnected (%s); legs aborted", ctx.request_id, why)

    async def _run(self, request: web.Request, ctx: RequestCtx) -> web.StreamResponse:
        num_prompt_tokens, shed = await self._admission.check(ctx.body, ctx.request_id)
        if shed is not None:
            ctx.outcome = "429"
            return shed
        if self._config.sse_keepalive_s > 0 and ctx.body.get("stream") is True:
            ctx.client = ClientStream(request, ctx.request_id, self._config.sse_keepalive_s)
            ctx.client.start()
        last: AttemptFailed | None = None
        excluded: set[str] = set()
        key = routing_text(ctx.body)  # the prompt's start, for prefix-affine policies
        num_tries = 0  # attempts since the stream started or last migrated
        for attempt_no in range(self._config.max_attempts * (1 + self._config.migration_limit)):
            if num_tries >= self._config.max_attempts:
                break
            if num_tries:
                self._stats.num_retries += 1
                await asyncio.sleep(self._backoff_s(num_tries))
            if ctx.is_aborted:
                break
            num_tries += 1
            plan = self._choose(
                excluded, key, num_prompt_tokens, needs_prompt_logits(ctx.path, ctx.body)
            )
            if plan is None:
                last = AttemptFailed(
                    "no healthy prefill+decode pair or colocated worker", status=503
                )
                logger.info("rid=%s attempt %d: %s", ctx.request_id, attempt_no, last.reason)
                continue
            # A retry gets its own id so a worker still tearing down the old one is not confused.
            rid = ctx.request_id if attempt_no == 0 else f"{ctx.request_id[:120]}.{attempt_no}"
            ctx.attempt = Attempt(
                self._env, plan, rid, ctx.request_id, ctx.path, ctx.tracker, ctx.client
            )
            body, raw_body = ctx.attempt_body()
            try:
                committed = await ctx.attempt.run(request, body, raw_body, ctx.started)
            except AttemptFailed as failure:
                last = failure
                if failure.blame is not None:
                    excluded.add(failure.blame.url)
                logger.info("rid=%s attempt %d failed: %s", ctx.request_id, attempt_no, failure)
                if failure.is_final:
                    break
                continue
            except StreamBroken as broken:
                excluded.add(broken.blame.url)
                last = AttemptFailed(broken.reason, blame=broken.blame)
                if not self._may_migrate(ctx, broken):
                    break
                num_tries = 0
                continue
            ctx.outcome = committed.outcome
            return committed.response
        if ctx.tracker is not None and ctx.tracker.out is not None:
            # Bytes reached the client: the status is sent, the stream ends with an error.
            reason = last.reason if last is not None else "request aborted"
            await end_broken_stream(ctx.tracker.out, reason, self._config.abort_timeout_s)
            ctx.outcome = "stream_error"
            return ctx.tracker.out
        response = self._failure_response(ctx, last)
        client = ctx.client
        if client is not None and await client.take() is not None:
            # Comments opened the stream: the error (one line of JSON) goes as an event.
            body = response.body if isinstance(response.body, bytes) else b"{}"
            event = b"data: " + body + b"\n\ndata: [DONE]\n\n"
            return await client.end_with_error(event, self._config.abort_timeout_s)
        return response

    def _may_migrate(self, ctx: RequestCtx, broken: StreamBroken) -> bool:
        """Count a migration of a broken stream, unless its limit is reached."""
        tracker = ctx.tracker
        assert tracker is not None
        if tracker.num_migrations >= self._config.migration_limit or ctx.is_aborted:
            logger.warning(
                "rid=%s: stream broke (%s), not migrated: %d migration(s) already",
                ctx.request_id, broken.reason, tracker.num_migrations,
            )  # fmt: skip
            return False
        tracker.num_migrations += 1
        self._stats.num_migrations += 1
        logger.info(
            "rid=%s: stream broke at %s (%s); migrating after %d token(s), migration %d/%d",
            ctx.request_id, broken.blame.url, broken.reason, len(tracker.token_ids),
            tracker.num_migrations, self._config.migration_limit,
        )  # fmt: skip
        return True

    def _failure_response(self, ctx: RequestCtx, last: AttemptFailed | None) -> web.Response:
        headers = {"X-Request-Id": ctx.request_id}
        if last is not None and last.reply is not None:
            reply = last.reply
            ctx.outcome = str(reply.status)
            headers["Content-Type"] = reply.content_type or "application/json"
            if reply.is_draining:  # every worker tried is draining: say when to come back
                headers["Retry-After"] = str(self._config.retry_after_s)
            return web.Response(status=reply.status, body=reply.body, headers=headers)
        if ctx.is_aborted:
            ctx.outcome = "503"
            return error_response(503, "request aborted", code="aborted", headers=headers)
        status = last.status if last is not None else 503
        reason = last.reason if last is not None else "no attempt made"
        ctx.outcome = str(status)
        if status == 503:  # no usable path now (down, draining): retryable, say when
            headers["Retry-After"] = str(self._config.retry_after_s)
        return error_response(status, f"router: {reason}", code="upstream_failed", headers=headers)

    def _backoff_s(self, attempt_no: int) -> float:
        cfg = self._config
        return backoff_s(attempt_no, cfg.backoff_base_s, cfg.max_backoff_s, self._rng)

    def _choose(
        self, excluded: set[str], key: str | None, num_prompt_tokens: int, is_scoring: bool
    ) -> Plan | None:
        # Both legs by the prompt's text: the prefill and the decode each keep a prefix cache
        # (a decode holding the prefix receives only the rest of the KV).
        prefills = self._workers.available("prefill")
        decodes = self._workers.available("decode")
        colocated = self._workers.available("colocated")
        if is_scoring and not colocated and decodes and not self._config.enforce_disagg:
            # Prompt logprobs come from the prompt's logits, which a PD pair leaves on the
            # prefill: a decode prefills the request itself and answers it whole.
            self._stats.num_scoring_on_decode += 1
            return Plan(None, self._pick("decode", decodes, excluded, key), num_prompt_tokens)
        if is_scoring and colocated:
            return Plan(None, self._pick("colocated", colocated, excluded, key), num_prompt_tokens)
        if not self._config.enforce_disagg and decodes:
            # Every prefill failed this request already (one killed a moment ago still looks
            # healthy until the next probe): the retry goes to a decode prefilling itself.
            prefills = [w for w in prefills if w.url not in excluded]
        if prefills and decodes:
            return Plan(
                self._pick("prefill", prefills, excluded, key),
                self._pick("decode", decodes, excluded, key),
                num_prompt_tokens,
            )
        if colocated:
            return Plan(None, self._pick("colocated", colocated, excluded, key), num_prompt_tokens)
        if decodes and not self._config.enforce_disagg:
            # No prefill is healthy: a decode prefills the request itself, colocated-style.
            self._stats.num_decode_fallbacks += 1
            return Plan(None, self._pick("decode", decodes, excluded, key), num_prompt_tokens)
        return None

    def _pick(
        self, role: str, candidates: list[Worker], excluded: set[str], key: str | None
    ) -> Worker:
        # Prefer workers that have not failed this request; fall back to all when none is left.
        preferred = [w for w in candidates if w.url not in excluded] or candidates
        return self._policies[role].choose(preferred, key)


def backoff_s(attempt_no: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Delay before retry ``attempt_no`` (1-based): exponential, capped, with jitter in
    [50%, 100%] so a burst of failed requests does not retry in lockstep."""
    ceiling = min(max_s, base_s * 2 ** (attempt_no - 1))
    return ceiling * rng.uniform(0.5, 1.0)
