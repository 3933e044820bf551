"""One attempt of a request over one path: start the legs at once, wait for the primary's
first event while watching the prefill leg, send the answer to the client, and on any
abnormal end cancel what still runs and abort what a worker may still hold.

A *path* is a prefill+decode pair (PD) or one colocated worker. The *primary* leg is the one
whose answer goes to the client (decode or colocated); the prefill leg's body is discarded
unless it is an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import orjson
from aiohttp import web

from pdserve.router.attempt_types import (
    DONE_EVENT,
    OK,
    OUTCOME_BY_KIND,
    PENDING,
    REPLY_ERROR,
    TRANSPORT_ERROR,
    AttemptEnv,
    AttemptFailed,
    ClientGone,
    Committed,
    Leg,
    Plan,
    StreamBroken,
    build_leg_bodies,
)
from pdserve.router.client_stream import ClientStream
from pdserve.router.errors import sse_error_event
from pdserve.router.legs import LegError, PrimaryStart, WriteFn, pump_events
from pdserve.router.migration import StreamTracker
from pdserve.router.workers import Worker

logger = logging.getLogger(__name__)


class Attempt:
    """Runs one try of one request over one path; :meth:`run` either returns the committed
    response or raises :class:`AttemptFailed` (nothing reached the client), ``ClientGone``,
    or :class:`StreamBroken` (a stream with a ``tracker`` broke and may be resumed; a
    tracker whose response is already prepared is such a resumption: its stream continues)."""

    def __init__(
        self,
        env: AttemptEnv,
        plan: Plan,
        request_id: str,
        client_request_id: str,
        path: str,
        tracker: StreamTracker | None = None,
        client: ClientStream | None = None,
    ) -> None:
        self._env = env
        self.tracker = tracker
        self.client = client  # keep-alive comments may have opened the client's stream
        self.plan = plan
        self.request_id = request_id  # sent to the workers; differs from the client's on retries
        self.client_request_id = client_request_id
        self.path = path
        self.room_id: str | None = None
        self.legs: list[Leg] = []
        # Set once the client has the stream's final ``data: [DONE]``: a client that hangs up
        # after that (before the upstream's end of body) did not abandon anything.
        self.delivered_status: int | None = None

    @property
    def _prefill(self) -> Leg | None:
        return self.legs[0] if len(self.legs) == 2 else None

    @property
    def _primary(self) -> Leg:
        return self.legs[-1]

    async def run(
        self, request: web.Request, body: dict[str, Any], raw_body: bytes, started: float
    ) -> Committed:
        """Run the attempt; raises AttemptFailed (nothing sent yet) or ClientGone."""
        self._start_legs(body, raw_body)
        is_clean = False
        try:
            start = await self._await_first_byte()
            if self.tracker is None or self.tracker.out is None:  # not a resumption
                self._env.stats.first_byte_latency.observe(time.monotonic() - started)
            committed, is_clean = await self._commit(request, start)
            return committed
        finally:
            self._finish(is_clean or self.delivered_status is not None)

    def abort_legs(self) -> None:
        """Forward an abort to every leg (the ``POST /abort/{rid}`` of the router)."""
        for leg in self.legs:
            self._env.spawn(self._abort_leg(leg))

    def _start_legs(self, body: dict[str, Any], raw_body: bytes) -> None:
        plan, upstream = self.plan, self._env.upstream
        if plan.prefill is None:
            primary_body = raw_body
            if "kv_transfer_params" in body:
                stripped = {k: v for k, v in body.items() if k != "kv_transfer_params"}
                primary_body = orjson.dumps(stripped)
        else:
            self.room_id = uuid.uuid4().hex
            kv = {
                "room_id": self.room_id,
                "bootstrap_host": plan.prefill.host,
                "bootstrap_port": plan.prefill.info.bootstrap_port if plan.prefill.info else None,
            }
            prefill_body, primary_body = build_leg_bodies(body, kv)
            coro = upstream.run_prefill(plan.prefill, self.path, self.request_id, prefill_body)
            self.legs.append(self._new_leg(plan.prefill, coro, plan.num_prompt_tokens))
        coro = upstream.open_primary(plan.primary, self.path, self.request_id, primary_body)
        # Without a prefill leg the primary prefills the prompt itself (colocated, fallback).
        tokens = plan.num_prompt_tokens if plan.prefill is None else 0
        self.legs.append(self._new_leg(plan.primary, coro, tokens))
        logger.debug(
            "rid=%s: attempt started room=%s prefill=%s primary=%s",
            self.request_id,
            self.room_id,
            plan.prefill.url if plan.prefill else None,
            plan.primary.url,
        )

    def _new_leg(self, worker: Worker, coro: Coroutine[Any, Any, Any], tokens: int) -> Leg:
        worker.breaker.on_attempt()
        worker.num_in_flight += 1
        worker.num_in_flight_tokens += tokens
        task = asyncio.create_task(coro)
        task.add_done_callback(_retrieve_exception)
        return Leg(worker, task, num_tokens=tokens)

    async def _await_first_byte(self) -> PrimaryStart:
        """Wait for the primary's first event while watching the prefill leg; the first failure
        of either fails the attempt (``_finish`` then cancels and aborts the other leg)."""
        prefill, primary = self._prefill, self._primary
        waiting = {leg.task for leg in self.legs}
        loop = asyncio.get_running_loop()
        timeout_s = self._env.config.effective_first_byte_timeout_s
        deadline = loop.time() + timeout_s
        while True:
            remaining = deadline - loop.time()
            done: set[asyncio.Task[Any]] = set()
            if remaining > 0:
                done, _ = await asyncio.wait(
                    waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
            if not done:
                # The leg that has not answered is the one holding things up.
                blame = prefill if prefill is not None and prefill.outcome == PENDING else primary
                self._verdict(blame, ok=False, reason="first byte timeout")
                raise AttemptFailed(
                    f"no first byte within {timeout_s:g}s", status=504, blame=blame.worker
                )
            waiting -= done
            if prefill is not None and prefill.task in done:
                self._settle(prefill)
            if primary.task in done:
                self._settle(primary)
                primary.start = primary.task.result()
                return primary.start

    def _settle(self, leg: Leg) -> None:
        """Record a finished leg's outcome; raises AttemptFailed if it failed."""
        exc = leg.task.exception()
        if leg is self._prefill:
            leg.release_in_flight()  # the primary keeps its slot until its stream ends
        else:
            leg.release_tokens()  # answered or failed: its prompt is no longer queued
        if exc is None:
            self._set_outcome(leg, OK, "answered")
            self._verdict(leg, ok=True)
            return
        if not isinstance(exc, LegError):
            self._set_outcome(leg, TRANSPORT_ERROR, repr(exc))
            self._verdict(leg, ok=False, reason=repr(exc))
            raise AttemptFailed(f"{leg.worker.url}: unexpected {exc!r}", blame=leg.worker)
        self._set_outcome(leg, OUTCOME_BY_KIND.get(exc.kind, REPLY_ERROR), exc.reason)
        if exc.reply is not None and exc.reply.is_client_error:
            self._verdict(leg, ok=True)  # the worker is fine; the request is not
            raise AttemptFailed(str(exc), status=exc.reply.status, reply=exc.reply, is_final=True)
        if exc.reply is not None and exc.reply.is_draining:
            # Before the first byte: retry elsewhere (no breaker failure) and stop routing there.
            self._verdict(leg, ok=True)
            leg.worker.mark_draining()
            raise AttemptFailed(str(exc), status=503, blame=leg.worker, reply=exc.reply)
        if exc.reply is not None and exc.reply.is_peer_failure:
            # It answered; its KV peer failed. Don't trip its breaker, and steer the retry away
            # from the peer: a decode reporting a dead/hung prefill blames that prefill.
            self._verdict(leg, ok=True)
            peer = self._prefill if leg is not self._prefill and self._prefill else leg
            raise AttemptFailed(str(exc), blame=peer.worker, reply=exc.reply)
        self._verdict(leg, ok=False, reason=exc.reason)
        raise AttemptFailed(str(exc), blame=leg.worker, reply=exc.reply)

    def _set_outcome(self, leg: Leg, outcome: str, reason: str) -> None:
        logger.debug(
            "rid=%s room=%s: leg %s %s -> %s (%s)",
            self.request_id,
            self.room_id,
            leg.worker.url,
            leg.outcome,
            outcome,
            reason,
        )
        leg.outcome = outcome

    def _verdict(self, leg: Leg, *, ok: bool, reason: str = "") -> None:
        if leg.has_verdict:
            return
        leg.has_verdict = True
        if ok:
            leg.worker.breaker.record_success()
        elif leg.worker.breaker.record_failure(reason):
            self._env.stats.breaker_opens[leg.worker.url] += 1

    async def _commit(self, request: web.Request, start: PrimaryStart) -> tuple[Committed, bool]:
        """Send the primary's answer to the client; returns (committed, ended cleanly)."""
        status = start.response.status
        logger.debug("rid=%s: committed status=%d sse=%s", self.request_id, status, start.is_sse)
        opened = await self.client.take() if self.client is not None else None
        if not start.is_sse and opened is not None:  # a 2xx that is not a stream, after comments
            await end_broken_stream(opened, "upstream answered without a stream", 1.0)
            return Committed(opened, "stream_error"), False
        if not start.is_sse:
            await self._settle_late_prefill()
            headers = {
                "X-Request-Id": self.client_request_id,
                "Content-Type": start.response.content_type,
            }
            response = web.Response(status=status, body=start.first, headers=headers)
            return Committed(response, str(status)), True
        tracker = self.tracker
        out = tracker.out if tracker is not None else None
        if out is None:
            out = opened  # None unless keep-alive comments opened it (status 200)
        if out is None:
            out = web.StreamResponse(
                status=status,
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Request-Id": self.client_request_id,
                },
            )
        timeout_s = self._env.config.request_timeout_s
        try:
            # Bounds a client that stops reading as well as a worker that stops writing.
            async with asyncio.timeout(timeout_s):
                if not out.prepared:
                    await out.prepare(request)
                if tracker is not None and tracker.out is None:
                    tracker.out, tracker.status = out, status
                write = self._writer(out, tracker.status if tracker else status)
                await write(start.first)
                await pump_events(self._primary.worker, start, write)
                if tracker is not None and not tracker.saw_done:
                    raise LegError(self._primary.worker, "stream ended before [DONE]", kind="eof")
        except ConnectionResetError as exc:
            raise ClientGone(out, str(exc)) from exc
        except (LegError, TimeoutError) as exc:
            reason = exc.reason if isinstance(exc, LegError) else f"over {timeout_s:g}s"
            self._blame_broken_stream(reason)
            if isinstance(exc, LegError) and tracker is not None and tracker.can_resume:
                raise StreamBroken(reason, self._primary.worker) from exc
            await end_broken_stream(out, reason, self._env.config.abort_timeout_s)
            return Committed(out, "stream_error"), False
        await self._settle_late_prefill()
        return Committed(out, str(tracker.status if tracker else status)), True

    def _writer(self, out: web.StreamResponse, status: int) -> WriteFn:
        tracker = self.tracker

        async def write(data: bytes) -> None:
            if tracker is not None:
                data = tracker.filter(data)
                if not data:
                    return
            await out.write(data)
            if data.endswith(DONE_EVENT):
                self.delivered_status = status

        return write

    def _blame_broken_stream(self, reason: str) -> None:
        primary = self._primary
        self._set_outcome(primary, TRANSPORT_ERROR, reason)
        primary.has_verdict = False  # its first byte counted as a success; this is a failure
        self._verdict(primary, ok=False, reason=reason)
        logger.warning("rid=%s: stream broke after first byte: %s", self.request_id, reason)

    async def _settle_late_prefill(self) -> None:
        """After the primary ended fine, give a still-running prefill leg a short grace to
        report; if it does not, ``_finish`` cancels and aborts it."""
        prefill = self._prefill
        if prefill is None or prefill.outcome != PENDING:
            return
        await asyncio.wait({prefill.task}, timeout=self._env.config.abort_timeout_s)
        if prefill.task.done():
            try:
                self._settle(prefill)
            except AttemptFailed as failure:
                logger.warning(
                    "rid=%s: prefill failed after decode answered: %s", self.request_id, failure
                )

    def _finish(self, is_clean: bool) -> None:
        """Cancel what still runs, release slots and trial claims, abort legs a worker may
        still hold. Synchronous, so it runs fully even while the handler is being cancelled."""
        for leg in self.legs:
            if not leg.task.done():
                leg.task.cancel()
            _close_response(leg, is_clean)
            leg.release_in_flight()
            if not leg.has_verdict:
                leg.worker.breaker.release()
            if leg.outcome in (PENDING, TRANSPORT_ERROR) or (not is_clean and leg.outcome == OK):
                logger.debug(
                    "rid=%s room=%s: leg %s ended %s -> aborting",
                    self.request_id,
                    self.room_id,
                    leg.worker.url,
                    leg.outcome,
                )
                self._env.spawn(self._abort_leg(leg))

    async def _abort_leg(self, leg: Leg) -> None:
        self._env.stats.num_aborts_sent += 1
        await self._env.upstream.post_abort(leg.worker, self.request_id)


async def end_broken_stream(out: web.StreamResponse, reason: str, timeout_s: float) -> None:
    """Bytes already reached the client and no retry is possible: end the stream with an
    error event and ``[DONE]``."""
    event = sse_error_event(f"upstream stream broke: {reason}", code="stream_broken")
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        async with asyncio.timeout(timeout_s):
            await out.write(event)


def _close_response(leg: Leg, is_clean: bool) -> None:
    start = leg.start
    if start is None:
        task = leg.task
        if not task.done() or task.cancelled() or task.exception() is not None:
            return
        start = task.result()  # the primary started, but the other leg failed first
        is_clean = False
    if not isinstance(start, PrimaryStart):
        return
    if is_clean:
        start.response.release()
    else:
        start.response.close()  # drops the connection: the worker sees its client leave


def _retrieve_exception(task: asyncio.Task[Any]) -> None:
    # Leg failures are read when the attempt needs them; this only silences "exception was
    # never retrieved" for legs the attempt stopped caring about.
    if not task.cancelled():
        task.exception()
