"""Tool calls as the official openai client assembles them, echo, the chat template fields and
/tokenize + /detokenize, over a really bound app with the prompt-replaying FakeEngine.

FakeEngine's "model" repeats the prompt, so a user message holding a Hermes ``<tool_call>``
comes back as one: what the parser and the streamed deltas must turn into typed tool_calls.
"""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from .conftest import assert_openai_error
from .engine_double import MODEL, FakeEngine

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
END = ["\n<assistant>"]  # the replay ends at the end of its prompt: finish_reason stop
CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=1024)  # room for a tool call replayed after its prompt


def _chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def _replay_len(content: str, header: str = "[tools=1]") -> int:
    # FakeEngine generates its prompt once over in exactly this many tokens (bytes).
    return len(f"{header}<user>{content}\n<assistant>".encode())


async def test_auto_tool_call_comes_back_typed(oai: AsyncOpenAI) -> None:
    completion = await oai.chat.completions.create(
        model=MODEL, messages=_chat(CALL), tools=TOOLS, max_tokens=_replay_len(CALL), stop=END
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    assert choice.message.content == "[tools=1]<user>"  # the text before the call


async def test_streamed_tool_call_deltas_assemble_in_the_openai_client(oai: AsyncOpenAI) -> None:
    async with oai.chat.completions.stream(
        model=MODEL,
        messages=_chat("Sure. " + CALL),
        tools=TOOLS,
        max_tokens=_replay_len("Sure. " + CALL),
        stop=END,
    ) as stream:
        contents = [e.delta async for e in stream if e.type == "content.delta"]
        final = await stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    # Streamed before the call began (the space next to the call is dropped, as unstreamed).
    assert "".join(contents) == "[tools=1]<user>Sure."
    assert final.choices[0].message.content == "[tools=1]<user>Sure."
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}


async def test_tool_choice_none_hides_tools_and_parses_nothing(oai: AsyncOpenAI) -> None:
    completion = await oai.chat.completions.create(
        model=MODEL,
        messages=_chat(CALL),
        tools=TOOLS,
        tool_choice="none",
        max_tokens=_replay_len(CALL, ""),
    )
    choice = completion.choices[0]
    assert choice.message.tool_calls is None and choice.message.content.startswith("<user>")


async def test_tool_turns_are_accepted_back(oai: AsyncOpenAI) -> None:
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    completion = await oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert "<tool>sunny" in completion.choices[0].message.content


async def test_echo_prepends_the_prompt(oai: AsyncOpenAI) -> None:
    completion = await oai.completions.create(model=MODEL, prompt="abc", max_tokens=2, echo=True)
    assert completion.choices[0].text == "abcab"
    stream = await oai.completions.create(
        model=MODEL, prompt="abc", max_tokens=2, echo=True, stream=True
    )
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == "abcab"


async def test_tokenize_round_trips_and_renders_chat_options(live_url: str) -> None:
    async with aiohttp.ClientSession() as http:

        async def post(path: str, body: dict) -> tuple[int, dict]:
            async with http.post(f"{live_url}{path}", json=body) as resp:
                return resp.status, await resp.json()

        status, tokens = await post("/tokenize", {"model": MODEL, "prompt": "héllo"})
        assert status == 200 and tokens["count"] == len("héllo".encode())
        assert tokens["max_model_len"] > 0 and tokens["token_strs"] is None
        status, text = await post("/detokenize", {"tokens": tokens["tokens"]})
        assert status == 200 and text == {"prompt": "héllo"}

        async def rendered(**fields: object) -> str:
            status, out = await post("/tokenize", {"messages": _chat("hi"), **fields})
            assert status == 200, out
            return bytes(out["tokens"]).decode()

        assert await rendered() == "<user>hi\n<assistant>"
        assert await rendered(add_generation_prompt=False) == "<user>hi\n"
        assert await rendered(chat_template_kwargs={"enable_thinking": False}) == (
            "[enable_thinking=False]<user>hi\n<assistant>"
        )
        assert await rendered(tools=TOOLS) == "[tools=1]<user>hi\n<assistant>"
        status, cont = await post("/tokenize", {
            "messages": [*_chat("hi"), {"role": "assistant", "content": "The answ"}],
            "continue_final_message": True, "add_generation_prompt": False,
        })  # fmt: skip
        assert status == 200 and bytes(cont["tokens"]).decode() == "<user>hi\n<assistant>The answ"
        status, err = await post("/detokenize", {"tokens": [1, 99999]})
        assert status == 400 and assert_openai_error(err, "tokens")
        status, err = await post("/tokenize", {"prompt": "x", "model": "other"})
        assert status == 404


async def test_chat_template_kwargs_and_continuation_reach_generation(oai: AsyncOpenAI) -> None:
    completion = await oai.chat.completions.create(
        model=MODEL,
        messages=[*_chat("hi"), {"role": "assistant", "content": "Once"}],
        max_tokens=32,
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "chat_template_kwargs": {"mode": 1}},
    )  # fmt: skip
    assert completion.choices[0].message.content.startswith("[mode=1]<user>hi\n<assistant>Once")
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(
            model=MODEL, messages=_chat("hi"), max_tokens=2,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )  # fmt: skip
    assert info.value.body["param"] == "continue_final_message"
