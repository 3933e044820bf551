"""Offline generation through the serving engine, like vLLM's ``LLM`` over its engine.

:class:`LLM` runs a colocated :class:`~pdserve.engine.engine.Engine` (same scheduler, prefix
cache, chunked prefill, stop checks and detokenization as the servers) on a private event loop
in a background thread, so plain synchronous code, and code already inside an event loop, can
both call :meth:`LLM.generate`. There is no second generation loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.protocol import GenerateRequest
from pdserve.engine.scheduler import SchedulerConfig
from pdserve.model_runner import ModelRunner
from pdserve.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str  # like the server's: stop strings trimmed, no trailing incomplete character
    finish_reason: str  # "stop" | "length"
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held


class LLM:
    """A started engine over ``runner``; close it (or use ``with``) to stop its threads and
    end the runner's tensor-parallel rank processes (so a TP > 1 runner serves one LLM; at TP1
    closing leaves the runner usable).

    ``scheduler`` defaults to the runner config's batch limits. Requests of one
    :meth:`generate` call run concurrently, batched by the scheduler; the prefix cache lives as
    long as the LLM, so later calls reuse the KV of earlier ones.
    """

    def __init__(self, runner: ModelRunner, scheduler: SchedulerConfig | None = None) -> None:
        cfg = runner.config
        self.scheduler_config = scheduler or SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs, max_prefill_tokens=cfg.max_prefill_tokens
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pdserve-llm-loop", daemon=True
        )
        self._thread.start()
        self._num_requests = 0
        self.engine = Engine(
            EngineConfig(role="colocated", engine_id="offline", scheduler=self.scheduler_config),
            runner,
            incarnation="offline",
        )
        try:
            self._call(self.engine.start())
        except BaseException:
            with contextlib.suppress(Exception):  # its loop task, and the runner's ranks
                self._call(self.engine.stop())
            self._stop_loop()
            raise

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """Generate for every prompt (each with its own copy of ``sampling``) until all end."""
        return self._call(self._generate(prompts, sampling))

    async def agenerate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """:meth:`generate`, awaitable from any event loop (the work runs on the LLM's own)."""
        future = asyncio.run_coroutine_threadsafe(self._generate(prompts, sampling), self._loop)
        return await asyncio.wrap_future(future)

    async def _generate(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> list[GenerationResult]:
        first = self._num_requests
        self._num_requests += len(prompts)
        return list(
            await asyncio.gather(
                *(self._one(f"gen-{first + i}", ids, sampling) for i, ids in enumerate(prompts))
            )
        )

    async def _one(self, rid: str, ids: list[int], sampling: SamplingParams) -> GenerationResult:
        req = GenerateRequest(rid, list(ids), dataclasses.replace(sampling))
        result = GenerationResult(list(ids), [], "", "length")
        texts = []
        # An EngineError propagates: a lost tensor-parallel rank fails this and later calls.
        async for out in self.engine.generate(req):
            result.token_ids += out.token_ids
            texts.append(out.text)
            result.num_cached_tokens = out.num_cached_tokens
            if out.finish_reason is not None:
                result.finish_reason, result.stop_reason = out.finish_reason, out.stop_reason
        result.text = "".join(texts)
        return result

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self.engine.stop())
        finally:
            self._stop_loop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    sampling: SamplingParams,
    scheduler: SchedulerConfig | None = None,
) -> list[GenerationResult]:
    """One-shot :meth:`LLM.generate` (starts and stops an engine around it)."""
    with LLM(runner, scheduler) as llm:
        return llm.generate(prompts, sampling)
