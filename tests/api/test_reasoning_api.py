"""--reasoning-parser through the HTTP API: recorded-format outputs (tests/data/reasoning) as
token sequences from an engine double, in every chunk size, split into reasoning_content and
content streamed and not; tool calls parsed from the answer only; the request fields; and the
real engine on the thinking demo answering JSON after its thinking, through the openai client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI
from prometheus_client import CollectorRegistry

from pdserve.api import build_app, start_http
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.protocol import GenerateOutput, GenerateRequest
from pdserve.model.demo import DemoShape, write_demo_model
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.model_runner import ModelRunner, RunnerConfig

from ..reasoning.conftest import output_cases
from .conftest import API_KEY, assert_openai_error, make_config
from .engine_double import MODEL, FakeEngine
from .sse_utils import parse_sse

CASES = output_cases()


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("think"), DemoShape(thinking=True))


class ScriptedEngine(FakeEngine):
    """Streams a recorded token sequence, ``chunk`` tokens per delta, detokenized as the real
    engine does (special tokens skipped, tags kept: they are added tokens, as in Qwen3)."""

    def __init__(self, tokenizer: Tokenizer, script: list[int], chunk: int) -> None:
        super().__init__(max_model_len=1024)
        self.tokenizer = tokenizer  # type: ignore[assignment]
        self.script, self.chunk = script, chunk

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
        ids = self.script[: request.sampling.max_tokens]
        for i in range(0, len(ids), self.chunk):
            part, is_last = ids[i : i + self.chunk], i + self.chunk >= len(ids)
            text = detok.step(part) + (detok.flush() if is_last else "")
            await asyncio.sleep(0)
            yield GenerateOutput(
                request.request_id, part, text, len(request.prompt_token_ids), i + len(part),
                "stop" if is_last else None,
            )  # fmt: skip


async def _post(engine: Any, body: dict[str, Any], parser: str | None = "qwen3") -> Any:
    app = build_app(engine, make_config(reasoning_parser=parser), CollectorRegistry())
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        resp = await client.post("/v1/chat/completions", json=body)
        return resp.status, await resp.read()


def _body(case: dict[str, Any], **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}
    if not case["starts_thinking"]:  # the template closes an empty block in the prompt
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return {**body, **fields}


def _streamed(raw: bytes) -> tuple[str, str, list[dict[str, Any]]]:
    chunks, is_done = parse_sse(raw)
    assert is_done
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    thought = "".join(d.get("reasoning_content") or "" for d in deltas)
    return thought, "".join(d.get("content") or "" for d in deltas), deltas


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
async def test_recorded_outputs_split_right_streamed_and_not(demo_dir, case, chunk) -> None:
    tok = Tokenizer.from_dir(demo_dir)
    script = tok.encode(case["text"], add_special_tokens=False) + sorted(tok.eos_token_ids)[:1]
    status, raw = await _post(ScriptedEngine(tok, script, chunk), _body(case, stream=True))
    assert status == 200, raw
    thought, content, deltas = _streamed(raw)
    assert (thought, content) == (case["reasoning"], case["content"])
    if case["starts_thinking"]:
        assert deltas[1].get("reasoning_content")  # thinking streams as it comes, not at the end
    status, raw = await _post(ScriptedEngine(tok, script, chunk), _body(case))
    message = orjson.loads(raw)["choices"][0]["message"]
    assert message["reasoning_content"] == (case["reasoning"] or None)
    assert message["content"] == case["content"]


async def test_each_choice_has_its_own_split(demo_dir) -> None:
    case = CASES[1]
    tok = Tokenizer.from_dir(demo_dir)
    script = tok.encode(case["text"], add_special_tokens=False)
    status, raw = await _post(ScriptedEngine(tok, script, 2), _body(case, n=2, stream=True))
    chunks, _ = parse_sse(raw)
    for index in (0, 1):
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == case["reasoning"]
        assert "".join(d.get("content") or "" for d in deltas) == case["content"]


async def test_tool_calls_are_parsed_from_the_answer_after_the_thinking(demo_dir) -> None:
    case = next(c for c in CASES if c["name"] == "empty_block_then_tool_call")
    tok = Tokenizer.from_dir(demo_dir)
    script = tok.encode(case["text"], add_special_tokens=False)
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    for stream in (False, True):
        body = _body(case, tools=tools, stream=stream)
        status, raw = await _post(ScriptedEngine(tok, script, 2), body)
        assert status == 200, raw
        if stream:
            deltas = _streamed(raw)[2]
            calls = _accumulated_calls(deltas)
            assert "".join(d.get("reasoning_content") or "" for d in deltas) == "\n\n"
        else:
            message = orjson.loads(raw)["choices"][0]["message"]
            calls = message["tool_calls"]
            assert message["reasoning_content"] == "\n\n"
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def _accumulated_calls(deltas: list[dict]) -> list[dict]:
    """Streamed tool-call deltas put together as the openai client does: the first delta of an
    index names the function, later ones append to its arguments."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        for part in delta.get("tool_calls") or []:
            call = calls.setdefault(part["index"], {"function": {"name": "", "arguments": ""}})
            function = part.get("function") or {}
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


async def test_include_reasoning_false_leaves_the_thinking_out(demo_dir) -> None:
    case = CASES[1]
    tok = Tokenizer.from_dir(demo_dir)
    script = tok.encode(case["text"], add_special_tokens=False)
    status, raw = await _post(ScriptedEngine(tok, script, 3), _body(case, include_reasoning=False))
    message = orjson.loads(raw)["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == case["content"]
    body = _body(case, include_reasoning=False, stream=True)
    status, raw = await _post(ScriptedEngine(tok, script, 3), body)
    thought, content, _ = _streamed(raw)
    assert thought == "" and content == case["content"]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"thinking_token_budget": -2}, "thinking_token_budget"),
        ({"thinking_budget": "many"}, "thinking_budget"),
        ({"max_reasoning_tokens": True}, "max_reasoning_tokens"),
        ({"thinking_token_budget": 4, "thinking_budget": 4}, "thinking_budget"),
        ({"include_reasoning": "yes"}, "include_reasoning"),
    ],
)
async def test_bad_reasoning_fields_are_a_400_naming_the_field(demo_dir, fields, param) -> None:
    engine = ScriptedEngine(Tokenizer.from_dir(demo_dir), [5], 1)
    status, raw = await _post(engine, _body(CASES[0], **fields))
    assert status == 400 and assert_openai_error(orjson.loads(raw), param)


async def test_a_budget_needs_a_reasoning_parser(demo_dir) -> None:
    engine = ScriptedEngine(Tokenizer.from_dir(demo_dir), [5], 1)
    status, raw = await _post(engine, _body(CASES[0], thinking_budget=8), parser=None)
    assert status == 400 and assert_openai_error(orjson.loads(raw), "thinking_budget")
    status, _ = await _post(engine, _body(CASES[0], thinking_token_budget=-1), parser=None)
    assert status == 200  # vLLM's "unlimited" is accepted anywhere
    status, _ = await _post(engine, _body(CASES[0], max_reasoning_tokens=8))
    assert status == 200 and engine.requests[-1].reasoning.max_tokens == 8


async def test_the_responses_api_answers_with_the_answer_only(demo_dir) -> None:
    case = CASES[2]
    tok = Tokenizer.from_dir(demo_dir)
    engine = ScriptedEngine(tok, tok.encode(case["text"], add_special_tokens=False), 4)
    app = build_app(engine, make_config(reasoning_parser="deepseek_r1"), CollectorRegistry())
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        resp = await client.post("/v1/responses", json={"model": MODEL, "input": "hi"})
        out = await resp.json()
    assert resp.status == 200, out
    assert out["output"][0]["content"][0]["text"] == case["content"]


def test_a_parser_whose_tags_are_not_tokens_of_the_model_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="not one token"):
        build_app(FakeEngine(), make_config(reasoning_parser="deepseek_r1"), CollectorRegistry())


@pytest_asyncio.fixture
async def real_oai(demo_dir: Path) -> AsyncIterator[AsyncOpenAI]:
    """The real engine on the thinking demo, served with --reasoning-parser qwen3."""
    runner = ModelRunner(RunnerConfig(model_dir=str(demo_dir), kv_cache_bytes=16 << 20))
    engine = Engine(EngineConfig(), runner, incarnation="test")
    await engine.start()
    app = build_app(engine, make_config(reasoning_parser="qwen3"), CollectorRegistry())
    http, port = await start_http(app, "127.0.0.1", 0)
    client = AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=60
    )
    try:
        yield client
    finally:
        await client.close()
        await http.cleanup()
        await engine.stop()


async def test_the_real_engine_thinks_then_answers_json_streamed_and_not(real_oai) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    args: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick a number, as JSON."}],
        max_tokens=80,
        temperature=0.8,
        seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        extra_body={"thinking_token_budget": 6},
    )
    done = await real_oai.chat.completions.create(**args)
    message = done.choices[0].message
    thought = message.model_extra["reasoning_content"]
    assert thought and "<think>" not in thought and "</think>" not in thought
    assert set(json.loads(message.content)) == {"n"}
    assert done.choices[0].finish_reason == "stop"
    stream = await real_oai.chat.completions.create(**args, stream=True)
    s_thought, s_content = "", ""
    async for chunk in stream:
        for choice in chunk.choices:
            s_thought += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            s_content += choice.delta.content or ""
    assert (s_thought, s_content) == (thought, message.content)
