"""The client side of an OpenAI-style SSE stream, for the benchmarks and the end-to-end tests.

A stream is ``data: {json}`` lines ending in ``data: [DONE]``; anything else (comments, blank
separator lines) is skipped. Each event carries the moment its line arrived, which is what TTFT
and inter-token latencies are measured from.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One ``data:`` line: its JSON object, or None for the ``[DONE]`` marker."""

    at: float  # time.perf_counter() when the line was read
    data: dict[str, Any] | None

    @property
    def is_done(self) -> bool:
        return self.data is None


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[SseEvent]:
    """The events of ``resp``'s body as they arrive. After ``[DONE]`` it reads on to the end of
    the body (a caller that stops there lets the server see a clean finish by reading on too).
    A line that is not JSON raises ``orjson.JSONDecodeError`` (a ``ValueError``)."""
    async for raw in resp.content:
        at = time.perf_counter()
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        yield SseEvent(at, None if payload == b"[DONE]" else orjson.loads(payload))


def choice_text(choice: dict[str, Any]) -> str:
    """The text one streamed choice adds (a chat ``delta.content`` or a completion ``text``)."""
    return (choice.get("delta") or {}).get("content") or choice.get("text") or ""
