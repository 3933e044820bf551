"""Streamed tool calls over the app, in OpenAI's delta shape: a call's first chunk carries its
index, id, type and name, later chunks append its arguments; the stream assembles to the
non-streamed message; the parser follows --tool-call-parser.

FakeEngine replays its prompt one byte per token, so a call's arguments arrive in many chunks.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from .conftest import chat_body, make_config
from .engine_double import FakeEngine
from .sse_utils import parse_sse

TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}},
]
END = ["\n<assistant>"]
HEADER = "[tools=2]<user>"  # FakeEngine's replay of the rendered prompt, before the content
TWO_CALLS = (
    'On it.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "note": "a}b"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "time", "arguments": {"tz": "UTC"}}\n</tool_call>'
)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=2048)


def _body(content: str, **fields: Any) -> dict[str, Any]:
    n = len(f"{HEADER}{content}\n<assistant>".encode())
    return chat_body(content, tools=TOOLS, max_tokens=n, stop=END, temperature=0, **fields)


async def _both(client: TestClient, body: dict[str, Any]) -> tuple[list[dict], dict]:
    resp = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert resp.status == 200
    events, is_done = parse_sse(await resp.read())
    assert is_done
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    return events, await resp.json()


def _assemble(events: list[dict]) -> tuple[str, list[dict[str, Any]], str | None]:
    content, calls, finish = "", {}, None
    for event in events:
        (choice,) = event["choices"]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for piece in delta.get("tool_calls", []):
            if piece["index"] not in calls:
                assert piece["id"].startswith("call_") and piece["type"] == "function"
                calls[piece["index"]] = {"id": piece["id"], "type": "function",
                                         "function": dict(piece["function"])}  # fmt: skip
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {
                    "arguments"
                }
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


async def test_two_calls_stream_in_the_openai_shape_and_equal_the_message(
    client: TestClient,
) -> None:
    events, whole = await _both(client, _body(TWO_CALLS))
    content, calls, finish = _assemble(events)
    message = whole["choices"][0]["message"]
    assert finish == "tool_calls" == whole["choices"][0]["finish_reason"]
    assert content == message["content"] == f"{HEADER}On it."
    strip = [{**c, "id": None} for c in calls]  # ids are per response
    assert strip == [{**c, "id": None} for c in message["tool_calls"]]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Oslo", "note": "a}b"},
        {"tz": "UTC"},
    ]
    pieces = [p for e in events for p in e["choices"][0]["delta"].get("tool_calls", [])]
    assert len(pieces) > 4  # the arguments streamed, not sent whole at the end


async def test_parallel_tool_calls_false_returns_only_the_first_call(client: TestClient) -> None:
    events, whole = await _both(client, _body(TWO_CALLS, parallel_tool_calls=False))
    _, calls, finish = _assemble(events)
    assert [c["function"]["name"] for c in calls] == ["weather"]
    assert [c["function"]["name"] for c in whole["choices"][0]["message"]["tool_calls"]] == [
        "weather"
    ]
    assert finish == "tool_calls"


@pytest.mark.parametrize("config", [make_config(tool_call_parser="qwen3_coder")])
async def test_the_flag_chooses_the_parser(client: TestClient) -> None:
    call = (
        "<tool_call>\n<function=time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>"
    )
    events, whole = await _both(client, _body(call))
    _, calls, _ = _assemble(events)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("time", {"tz": "UTC"})
    ]
    assert whole["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "time"
