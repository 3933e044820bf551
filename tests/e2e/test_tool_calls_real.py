"""Tool calls on a real model, Qwen2.5-Coder-0.5B-Instruct (Q4_K_M; its chat template is
Hermes-style, so ``auto`` picks the hermes parser), served colocated, greedy: the official
openai client's streamed accumulation equals the non-streamed message; langchain's
``bind_tools`` + ``astream`` and openai-agents each run a two-tool loop (weather, then time).

Kept short for CI: two tools, a handful of prompts, at most 64 tokens an answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from tests.real_models import QWEN_05B, real_model

from .procs import Proc, worker

MAX_TOKENS = 64
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the current local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
]  # fmt: skip
PROMPTS = ["What is the weather in Paris?", "What time is it in Tokyo?"]
TWO_TOOLS = "What is the weather in Paris? Then tell me the time in Tokyo."


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    model = real_model(QWEN_05B)
    tmp = tmp_path_factory.mktemp("qwen-tools")
    proc = worker(tmp, "qwen-tools", "colocated", Path(model), "--num-threads", "2",
                  "--kv-cache-mb", "128").start()  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _client(proc: Proc) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{proc.url}/v1", api_key="x", max_retries=0, timeout=120)


def _message_shape(message: Any) -> tuple[Any, list[tuple[str, Any]]]:
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    return message.content, calls


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_the_openai_clients_stream_assembles_to_the_unstreamed_message(
    qwen: Proc, prompt: str
) -> None:
    request: dict[str, Any] = {
        "model": "demo",
        "messages": [{"role": "user", "content": prompt}],
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    async with _client(qwen) as client:
        whole = await client.chat.completions.create(**request)
        async with client.chat.completions.stream(**request) as stream:
            async for _ in stream:
                pass
            streamed = await stream.get_final_completion()
    assert whole.choices[0].finish_reason == "tool_calls"
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert _message_shape(streamed.choices[0].message) == _message_shape(whole.choices[0].message)
    assert _message_shape(whole.choices[0].message)[1][0][0] in ("get_weather", "get_time")


# Defaults: a 0.5B model sometimes leaves an argument out; the loop, not its skill, is tested.
def get_weather(city: str = "here") -> str:
    """Get the current weather in a city."""
    return f"It is sunny and 21 C in {city}."


def get_time(city: str = "here") -> str:
    """Get the current local time in a city."""
    return f"It is 14:05 in {city}."


async def test_langchain_bind_tools_astream_runs_a_two_tool_loop(qwen: Proc) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="demo", base_url=f"{qwen.url}/v1", api_key="x", temperature=0,
                     max_tokens=MAX_TOKENS, max_retries=0, timeout=120)  # fmt: skip
    tools = {"get_weather": get_weather, "get_time": get_time}
    bound = llm.bind_tools(list(tools.values()))
    messages: list[Any] = [HumanMessage(TWO_TOOLS)]
    called: list[str] = []
    for _ in range(2):  # bounded: tool turns until both tools ran
        reply = None
        async for chunk in bound.astream(messages):
            reply = chunk if reply is None else reply + chunk
        assert reply is not None and reply.tool_calls
        messages.append(reply)
        for call in reply.tool_calls:
            called.append(call["name"])
            result = tools[call["name"]](**call["args"])
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
        if set(called) == set(tools):
            break
    assert set(called) == set(tools)
    # The answer turn: a 0.5B model would go on calling, so the loop asks for text, as agent
    # loops do at their last turn.
    answer = None
    async for chunk in llm.bind_tools(list(tools.values()), tool_choice="none").astream(messages):
        answer = chunk if answer is None else answer + chunk
    assert answer is not None and not answer.tool_calls and answer.content.strip()


async def test_openai_agents_runs_a_two_tool_loop(qwen: Proc) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        StopAtTools,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no trace export: nothing leaves the machine
    async with _client(qwen) as client:
        agent = Agent(
            name="assistant",
            instructions="You are a helpful assistant. Use the tools to answer.",
            model=OpenAIChatCompletionsModel(model="demo", openai_client=client),
            model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS),
            tools=[function_tool(get_weather), function_tool(get_time)],
            # The run ends with the time: weather first, then time, is the two-tool loop.
            tool_use_behavior=StopAtTools(stop_at_tool_names=["get_time"]),
        )
        result = await Runner.run(agent, TWO_TOOLS, max_turns=4)
    calls = [item.raw_item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert {c.name for c in calls} == {"get_weather", "get_time"}
    assert len(outputs) == len(calls)
    assert str(result.final_output).startswith("It is 14:05 in")  # get_time's output
