"""The engine: admits requests, runs the schedule -> forward -> postprocess loop, streams outputs.

One engine per server process, any role. The model runner runs on one executor thread so the event
loop (HTTP, heartbeats, KV transfers) stays responsive during a forward. Disaggregation is composed
in through a :class:`~pdserve.engine.handoff.Handoff`; the loop itself does not branch on role
beyond asking the handoff.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pdserve.engine.admission import check_prefill_time, new_request
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_lease import CpuLease
from pdserve.engine.handoff import Handoff
from pdserve.engine.health import EngineHealth
from pdserve.engine.introspection import count_by_state, oldest_age_by_state
from pdserve.engine.page_frees import PageFrees
from pdserve.engine.prefill_rate import PrefillRate
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.protocol import (
    EngineError,
    EngineInfo,
    GenerateOutput,
    GenerateRequest,
    TokenLogprob,
)
from pdserve.engine.request import Request, RequestState
from pdserve.engine.runner_thread import RunnerThread
from pdserve.engine.scheduler import Batch, Scheduler
from pdserve.engine.stats import EngineObserver
from pdserve.engine.step_output import StepOutputs
from pdserve.engine.warmup import warm_up
from pdserve.kernels.kv_cache import PageAllocator
from pdserve.kernels.kv_ready import ALWAYS_READY
from pdserve.model_runner import ModelRunner
from pdserve.reasoning.gate import grammar_sees
from pdserve.thread_tuning import should_calibrate

logger = logging.getLogger(__name__)


class Engine:
    """Implements :class:`~pdserve.engine.protocol.EngineClient`; its step results are
    committed by :class:`~pdserve.engine.step_output.StepOutputs`."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        *,
        incarnation: str,
        observer: EngineObserver | None = None,
        runner_thread: RunnerThread | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.allocator = PageAllocator(runner.kv_config.num_pages)
        page_size = runner.kv_config.page_size
        # Every role caches (a decode's prompt pages arrive by transfer, after its prefix).
        self.prefix_cache = PrefixCache(
            self.allocator, page_size, enabled=config.scheduler.prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.allocator, page_size, self.prefix_cache)
        self.observer = observer or EngineObserver()
        self.handoff: Handoff | None = None
        self.info = EngineInfo(
            role=config.role,
            model_name=config.model_name,
            max_model_len=runner.max_model_len,
            engine_id=config.engine_id,
            incarnation=incarnation,
        )
        self._requests: dict[str, Request] = {}
        self.health = EngineHealth(runner, self._requests, self._fail)  # a lost rank ends it
        self._runner_thread = runner_thread or RunnerThread()  # the one that loaded the model
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._frees = PageFrees(self.allocator, self._on_pages_freed)
        self.prefill_rate = PrefillRate()  # of this engine's recent prefill steps
        self.steps = StepOutputs(runner, self.scheduler, self)  # runs and commits each step
        self._ready = False
        self._idle = asyncio.Event()  # set while no request is admitted (a drain waits on it)
        self._idle.set()

    # ---- lifecycle -------------------------------------------------------------------------
    def attach_handoff(self, handoff: Handoff, bootstrap_port: int | None = None) -> None:
        self.handoff = handoff
        if bootstrap_port is not None:
            info = self.info
            self.info = EngineInfo(
                info.role, info.model_name, info.max_model_len, info.engine_id,
                info.incarnation, bootstrap_port,
            )  # fmt: skip

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name="pdserve-engine")
        self.health.start()
        await self._warmup()
        self._ready = True

    async def stop(self, code: str | None = None) -> None:
        """Fail every request left with a 503 (``code``: e.g. ``drain_timeout``) and stop."""
        self._ready = False
        for req in list(self._requests.values()):
            msg = "server shutting down" if code is None else f"server shutting down ({code})"
            self._fail(req, EngineError(msg, 503, "service_unavailable", code))
        tasks = [t for t in (self._loop_task, *self._frees.waits) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._runner_thread.stop()
        await self.health.close()  # the runner's rank processes end with this engine

    @property
    def cpu_lease(self) -> CpuLease | None:
        """The lease this engine's steps take turns with (None: the cores are its own)."""
        return self._runner_thread.lease

    def is_ready(self) -> bool:
        task = self._loop_task
        return self._ready and self.health.error is None and task is not None and not task.done()

    async def _warmup(self) -> None:
        runner = self.runner
        calibrate = should_calibrate(
            self.config.role, runner.device.type, runner.config.decode_threads,
            runner.prefill_threads,
        )  # fmt: skip
        await warm_up(
            runner, self.allocator, self._runner_thread, calibrate=calibrate,
            max_num_seqs=self.config.scheduler.max_num_seqs, engine_id=self.info.engine_id,
        )  # fmt: skip

    # ---- public API ------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        req = self._admit(request)
        try:
            while True:
                item = await req.outputs.get()
                if isinstance(item, EngineError):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not req.is_finished:
                self._abort_request(req, "aborted: consumer went away")

    async def abort(self, request_id: str, reason: str = "aborted") -> bool:
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._abort_request(req, reason)
        return True

    # ---- admission -------------------------------------------------------------------------
    def _admit(self, request: GenerateRequest) -> Request:
        if not self.is_ready():
            raise self.health.refusal()
        if request.request_id in self._requests:
            raise EngineError(
                f"request id {request.request_id!r} is already in flight", 409, "conflict_error"
            )
        req = new_request(
            request, self.runner.kv_config, self.allocator.num_pages, self.info.max_model_len,
            self.tokenizer,
        )  # fmt: skip
        sp, num_prompt = req.seq.sampling, req.seq.num_prompt_tokens
        # Bounded in every state, RUNNING and re-queued after preemption included.
        total = request.deadline_s or self.config.deadlines.overall_s(
            min(num_prompt + sp.max_tokens, self.info.max_model_len)
        )
        if req.kv_transfer is None or self.config.role == "prefill":  # it prefills here
            check_prefill_time(num_prompt, total, self.prefill_rate)
        self._requests[req.request_id] = req
        self._idle.clear()
        self.observer.on_arrival(req)
        req.overall_deadline = asyncio.get_running_loop().call_later(
            total, self._on_deadline, req, "timeout:request"
        )
        try:
            if self.handoff is not None:
                self.handoff.admit(req)
            else:
                self.enqueue_prefill(req)
        except BaseException:
            self._forget(req)
            self._cancel_timers(req)
            raise
        return req

    def enqueue_prefill(self, req: Request) -> None:
        if req.seq.grammar is not None:
            req.seq.grammar.prefetch()  # its first mask, filled while it waits and prefills
        self.scheduler.add(req)
        self.arm(req, self.config.deadlines.waiting_s, "timeout:waiting")
        self._wake.set()

    # ---- the loop --------------------------------------------------------------------------
    async def _run(self) -> None:
        decodes = self.config.role != "prefill"
        while True:
            batch = self.scheduler.schedule(decode=decodes)
            if self.handoff is not None:
                self.handoff.on_pages_freed()  # arrivals may go once no preempted request waits
            if batch is None:
                if self.steps.has_deferred:
                    self.steps.emit_deferred()  # may end requests and free pages: schedule again
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            seqs = (batch.decode, batch.prefill_seqs())
            num_prefill_tokens = self._on_prefill_progress(batch)
            self._frees.begin_step()
            started = time.monotonic()
            fut = self._runner_thread.submit(self.steps.run, seqs)
            # Overlap: the last step's detokenization, stop checks and streaming, with this one.
            self.steps.emit_deferred()
            kv_ready = ALWAYS_READY  # a failed step: what it queued on the device is not known
            try:
                out = await fut
                kv_ready = out.kv_ready
                self.prefill_rate.observe(num_prefill_tokens, time.monotonic() - started)
            except Exception as e:  # its batch fails; with tensor-parallel ranks, the engine
                await self.health.step_failed(batch.kind, batch.requests, e)
                continue
            finally:
                self._frees.end_step(kv_ready)
            self.steps.apply(batch, out.decode, out.prefill)

    def _on_prefill_progress(self, batch: Batch) -> int:
        """A step with prompt chunks is scheduled, so the last one ended: every prefilling
        request's no-progress deadline starts again (those whose turn comes later too: the
        engine's prefill is moving). Returns the step's prompt tokens."""
        for req in self.scheduler.prefilling if batch.prefill else ():
            self.arm(req, self.config.deadlines.prefill_progress_s, "timeout:prefilling")
        return batch.num_prefill_tokens()

    # ---- outputs and endings ---------------------------------------------------------------
    def emit(self, req: Request, ids: list[int], logprobs: list[TokenLogprob] | None) -> None:
        out = req.out_state.update(ids, logprobs)
        out.num_cached_tokens = req.num_cached_prompt_tokens or 0
        if req.prompt_logprobs is not None:
            out.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
        self.observer.on_tokens(req, len(ids))
        req.outputs.put(out)
        if out.finish_reason is not None:
            self._finish(req, out.finish_reason)

    def start_decoding(
        self, req: Request, first_token: int, logprob: TokenLogprob | None = None
    ) -> None:
        """Decode role: the KV of the prompt arrived; the first token came with it."""
        seq = req.seq
        seq.num_cached_tokens = seq.num_tokens
        self.prefix_cache.register(seq, req.page_keys)  # the prompt's full pages, for reuse
        seq.token_ids.append(first_token)
        req.move(RequestState.RUNNING, "kv received")
        self.disarm(req)
        # The prefill sampled it under the same grammar: this matcher continues from there.
        is_fed = grammar_sees(seq, first_token)  # a thinking block: the grammar sleeps
        if seq.grammar is not None:
            if is_fed and not self.steps.advance_grammar(req, first_token):
                return
            seq.grammar.prefetch()
        self.emit(req, [first_token], [logprob] if logprob is not None else None)
        if not req.is_finished:
            self.scheduler.add_running(req)
            self._wake.set()

    def finish_with(self, req: Request, ids: list[int], finish_reason: str) -> None:
        """End a request with a last delta (the prefill leg ends after its first token)."""
        out = req.out_state.update(ids, None)
        out.num_cached_tokens = req.num_cached_prompt_tokens or 0
        out.finish_reason = out.finish_reason or finish_reason
        self.observer.on_tokens(req, len(ids))
        req.outputs.put(out)
        self._finish(req, out.finish_reason)

    def fail(self, req: Request, error: EngineError) -> None:
        self._fail(req, error)

    def _fail(self, req: Request, error: EngineError) -> None:
        if req.is_finished:
            return
        req.error = error
        logger.info("req=%s room=%s failed: %s", req.request_id, req.room_id, error.message)
        req.outputs.put(error)
        self._finish(req, "error", reason=error.message)

    def _abort_request(self, req: Request, reason: str) -> None:
        if req.is_finished:
            return
        self.observer.on_abort(req)
        req.outputs.put(
            GenerateOutput(req.request_id, [], "", req.seq.num_prompt_tokens,
                           req.seq.num_generated, finish_reason="abort")
        )  # fmt: skip
        self._finish(req, "abort", reason=reason)

    def _finish(self, req: Request, status: str, reason: str | None = None) -> None:
        prev = req.state
        if not req.move(RequestState.FINISHED, reason or status):
            return
        req.finish_reason = status
        self._cancel_timers(req)
        self.scheduler.remove(req)
        if self.handoff is not None:
            self.handoff.on_finish(req, prev, reason or status)
        if req.seq.page_ids and not req.pages_in_room:
            self.free_pages(self.scheduler.release_pages(req))
        elif req.pages_in_room and req.num_prefix_pages:
            # Its room frees the pages lent to it; the cached prefix before them is ours.
            self.free_pages(req.seq.page_ids[: req.num_prefix_pages])
        if not self._frees.is_stepping:
            # While a forward runs it may read these page ids (an abort between schedule() and
            # the forward): the free above waits for the step, and no one schedules them again.
            req.seq.page_ids = []
        self._forget(req)
        self.observer.on_finish(req, status)

    def _forget(self, req: Request) -> None:
        self._requests.pop(req.request_id, None)
        if not self._requests:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no request is admitted (any state, a prefill's KV hand-off included)."""
        await self._idle.wait()

    def free_pages(self, pages: list[int]) -> None:
        """Give pages back once nothing may still write them (engine/page_frees.py)."""
        self._frees.free(pages)

    def _on_pages_freed(self) -> None:
        self._wake.set()
        if self.handoff is not None:
            self.handoff.on_pages_freed()

    # ---- deadlines -------------------------------------------------------------------------
    def arm(self, req: Request, seconds: float, label: str) -> None:
        self.disarm(req)
        req.deadline = asyncio.get_running_loop().call_later(seconds, self._on_deadline, req, label)
        req.deadline_label = label

    def disarm(self, req: Request) -> None:
        if req.deadline is not None:
            req.deadline.cancel()
            req.deadline = None

    def _cancel_timers(self, req: Request) -> None:
        self.disarm(req)
        if req.overall_deadline is not None:
            req.overall_deadline.cancel()
            req.overall_deadline = None

    def _on_deadline(self, req: Request, label: str) -> None:
        if req.is_finished:
            return
        self.observer.on_timeout(req, label)
        state = req.state.value
        msg = f"request {req.request_id} timed out in state {state} ({label})"
        self._fail(req, EngineError(msg, 504, "timeout", label))

    # ---- introspection ---------------------------------------------------------------------
    def count_by_state(self) -> dict[str, int]:
        return count_by_state(self._requests.values())

    def oldest_age_by_state(self) -> dict[str, float]:
        return oldest_age_by_state(self._requests.values())

    def load(self) -> dict[str, int]:
        """What a router weighs this worker by: requests per state and free KV pages.

        ``free_pages`` counts what a new request can get now: empty pages and unreferenced
        cached ones (evicted on demand), so a warm prefix cache never reads as a full pool."""
        alloc = self.allocator
        return {
            **self.count_by_state(),
            "num_requests": len(self._requests),
            "waiting_prompt_tokens": self.scheduler.num_prompt_tokens_queued(),
            "free_pages": alloc.num_available,
            "total_pages": alloc.num_pages,
            "page_size": self.runner.kv_config.page_size,
        }

    def debug_requests(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [r.debug_dict(now) for r in self._requests.values()]

    def debug_rooms(self) -> list[dict[str, Any]]:
        return self.handoff.debug_rooms() if self.handoff is not None else []
