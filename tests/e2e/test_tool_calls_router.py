"""Streamed tool calls through the router to a prefill/decode pair (demo model): the router
passes the decode's SSE through untouched, so the official openai client assembles the same
message streamed as not. The grammar of a forced choice makes the random-weight model call."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import AsyncOpenAI

from .conftest import Cluster

UNIT = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": UNIT}},
    {"type": "function", "function": {"name": "get_time", "parameters": UNIT}},
]
CHOICES = {
    "required": "required",
    "named": {"type": "function", "function": {"name": "get_time"}},
}


def _shape(message: Any) -> tuple[Any, list[tuple[str, Any]]]:
    calls = message.tool_calls or []
    return message.content, [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("choice", sorted(CHOICES))
async def test_a_forced_call_streams_through_the_router_as_it_is_unstreamed(
    pd_cluster: Cluster, choice: str
) -> None:
    request: dict[str, Any] = {
        "model": "demo",
        "messages": [{"role": "user", "content": "What is the weather?"}],
        "tools": TOOLS,
        "tool_choice": CHOICES[choice],
        "parallel_tool_calls": False,  # required: one call, so the grammar ends it
        "temperature": 0,
        "max_tokens": 48,
    }
    client = AsyncOpenAI(base_url=f"{pd_cluster.router.url}/v1", api_key="x", max_retries=0)
    async with client:
        whole = await client.chat.completions.create(**request)
        async with client.chat.completions.stream(**request) as stream:
            pieces = [e for e in [c async for c in stream] if e.type == "chunk"]
            streamed = await stream.get_final_completion()
    assert whole.choices[0].finish_reason == streamed.choices[0].finish_reason == "tool_calls"
    assert _shape(streamed.choices[0].message) == _shape(whole.choices[0].message)
    (call,) = _shape(whole.choices[0].message)[1]
    assert call[0] in ("get_weather", "get_time") and call[1]["unit"] in ("celsius", "fahrenheit")
    deltas = [d for p in pieces for d in (p.chunk.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == call[0]
    assert all(d.index == 0 and d.id is None for d in deltas[1:])  # later pieces: arguments
