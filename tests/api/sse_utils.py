"""Parsing SSE bodies in tests."""

from __future__ import annotations

import orjson


def parse_sse(raw: bytes) -> tuple[list[dict], bool]:
    """The JSON events of an SSE body and whether it ended with ``data: [DONE]``."""
    events: list[dict] = []
    is_done = False
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: "), block
        data = block[len(b"data: ") :]
        assert not is_done, "event after [DONE]"
        if data == b"[DONE]":
            is_done = True
        else:
            events.append(orjson.loads(data))
    return events, is_done
