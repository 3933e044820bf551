"""Runs one engine stream per choice and merges their deltas for a handler.

The handler reads batches of ``(choice_index, GenerateOutput)`` and always calls :meth:`aclose`
(in a ``finally``): every choice that has not finished is then aborted in the engine, whether the
handler ends normally, on an error, on a deadline, or because the client went away.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.api.errors import ApiError
from pdserve.engine.protocol import EngineClient, GenerateOutput, GenerateRequest

logger = logging.getLogger(__name__)

Event = tuple[int, GenerateOutput | BaseException]


class ChoiceStreams:
    """Concurrent engine streams for the choices of one HTTP request."""

    def __init__(
        self,
        engine: EngineClient,
        requests: list[GenerateRequest],
        abort_timeout_s: float,
        deadline_s: float | None = None,
    ) -> None:
        self._engine = engine
        self._requests = requests
        self._abort_timeout_s = abort_timeout_s
        self._deadline_s = deadline_s
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._is_finished = [False] * len(requests)
        self._num_finished = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._deadline_at: float | None = None
        self._close_task: asyncio.Task[None] | None = None
        self._pending_error: BaseException | None = None

    @property
    def is_done(self) -> bool:
        return self._num_finished == len(self._requests)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._deadline_s is not None:
            self._deadline_at = loop.time() + self._deadline_s
        self._tasks = [
            asyncio.create_task(self._pump(i, req), name=f"pump:{req.request_id}")
            for i, req in enumerate(self._requests)
        ]

    async def _pump(self, index: int, request: GenerateRequest) -> None:
        last: GenerateOutput | None = None
        stream = self._engine.generate(request)
        try:
            async for out in stream:
                self._queue.put_nowait((index, out))
                last = out
                if out.finish_reason is not None:
                    return
        except Exception as exc:  # handed to the handler, which owns the reaction
            self._queue.put_nowait((index, exc))
            return
        finally:
            await _close_stream(stream, request.request_id)
        # The engine contract says the last delta carries finish_reason; end the choice anyway.
        logger.warning("request %s: engine stream ended without finish_reason", request.request_id)
        self._queue.put_nowait((index, _ended(request, last)))

    async def next_batch(self) -> list[tuple[int, GenerateOutput]]:
        """Wait for at least one delta and take every delta already queued; [] when all ended.

        Raises the engine's exception for a failed choice, or a 504 :class:`ApiError` when the
        HTTP-side deadline backstop passes first.
        """
        if self._pending_error is not None:
            raise self._pending_error
        if self.is_done:
            return []
        try:
            async with asyncio.timeout_at(self._deadline_at):  # None: no backstop, no timer
                event = await self._queue.get()
        except TimeoutError:
            raise ApiError(
                504,
                f"Request exceeded its deadline of {self._deadline_s:g} s.",
                err_type="timeout",
                code="timeout:request",
            ) from None
        batch: list[tuple[int, GenerateOutput]] = []
        while True:
            index, item = event
            if isinstance(item, BaseException):
                if not batch:
                    raise item
                self._pending_error = item  # deliver the deltas before it first
                return batch
            batch.append((index, item))
            self._mark(index, item)
            if self._queue.empty():
                return batch
            event = self._queue.get_nowait()

    def _mark(self, index: int, out: GenerateOutput) -> None:
        if out.finish_reason is not None and not self._is_finished[index]:
            self._is_finished[index] = True
            self._num_finished += 1

    async def aclose(self, reason: str) -> None:
        """Abort unfinished choices in the engine and stop the pumps; safe to call twice.

        Shielded: a second cancellation of the handler must not skip the engine aborts.
        """
        if self._close_task is None:
            self._close_task = asyncio.create_task(self._close(reason))
        await asyncio.shield(self._close_task)

    async def _close(self, reason: str) -> None:
        unfinished = [
            req.request_id
            for req, is_finished in zip(self._requests, self._is_finished, strict=True)
            if not is_finished
        ]
        if unfinished:
            logger.info("aborting %s: %s", ", ".join(unfinished), reason)
            await asyncio.gather(*(self._abort(rid, reason) for rid in unfinished))
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self._abort_timeout_s)

    async def _abort(self, request_id: str, reason: str) -> None:
        try:
            async with asyncio.timeout(self._abort_timeout_s):
                await self._engine.abort(request_id, reason)
        except TimeoutError:
            logger.warning(
                "request %s: engine.abort timed out after %ss", request_id, self._abort_timeout_s
            )
        except Exception:
            logger.exception("request %s: engine.abort failed", request_id)


async def _close_stream(stream: object, request_id: str) -> None:
    # Close the engine's generator now rather than at garbage collection, so its cleanup runs.
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        logger.exception("request %s: closing the engine stream failed", request_id)


def _ended(request: GenerateRequest, last: GenerateOutput | None) -> GenerateOutput:
    return GenerateOutput(
        request_id=request.request_id,
        token_ids=[],
        text="",
        num_prompt_tokens=len(request.prompt_token_ids),
        num_generated_tokens=0 if last is None else last.num_generated_tokens,
        finish_reason="abort",
    )
