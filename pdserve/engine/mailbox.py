"""The per-request channel from the engine loop to the request's one consumer.

Cheaper than an ``asyncio.Queue`` (no future per ``put``; one waiter at most) and it coalesces:
a consumer that fell behind (a slow client, a busy loop) takes every delta queued so far as one
merged delta, so it writes one SSE event instead of a burst. An error is delivered after the
deltas queued before it, never merged into them.
"""

from __future__ import annotations

import asyncio
from collections import deque

from pdserve.engine.protocol import EngineError, GenerateOutput

Item = GenerateOutput | EngineError


class OutputMailbox:
    """Written by the engine on the event loop; read by one consumer task."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Item:
        """The next delta (everything queued so far, merged) or error; waits when empty."""
        while not self._items:
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                self._waiter = None
        return self._take()

    def _take(self) -> Item:
        items = self._items
        first = items.popleft()
        if isinstance(first, EngineError):
            return first
        run = [first]
        while items and _can_merge(run[0], items[0]):
            run.append(items.popleft())  # type: ignore[arg-type]
        return first if len(run) == 1 else merge_outputs(run)


def _can_merge(first: GenerateOutput, nxt: Item) -> bool:
    # Logprobs stay aligned with token ids only if every delta of the run has them or none.
    return isinstance(nxt, GenerateOutput) and (first.logprobs is None) == (nxt.logprobs is None)


def merge_outputs(outs: list[GenerateOutput]) -> GenerateOutput:
    """One delta equal to ``outs`` streamed in order (the last one's counters and ending)."""
    last = outs[-1]
    logprobs = None
    if last.logprobs is not None:
        logprobs = [lp for o in outs for lp in o.logprobs or ()]
    return GenerateOutput(
        request_id=last.request_id,
        token_ids=[t for o in outs for t in o.token_ids],
        text="".join(o.text for o in outs),
        num_prompt_tokens=last.num_prompt_tokens,
        num_generated_tokens=last.num_generated_tokens,
        finish_reason=last.finish_reason,
        logprobs=logprobs,
        stop_reason=last.stop_reason,
    )
