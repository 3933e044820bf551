"""/v1/responses basics with the official openai client's ``client.responses.create``: a string
or messages in, ``output_text`` out, plain and streamed; what it cannot serve is a 400."""

from __future__ import annotations

import openai
import pytest
from openai import AsyncOpenAI

from pdserve.api import ApiConfig

from .conftest import API_KEY, make_config
from .engine_double import MODEL


@pytest.fixture
def config() -> ApiConfig:
    return make_config(api_key=API_KEY)


async def test_string_input_gives_output_text_as_chat_would(oai: AsyncOpenAI) -> None:
    chat = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hey"}], max_tokens=8
    )
    resp = await oai.responses.create(model=MODEL, input="hey", max_output_tokens=8)
    assert resp.object == "response" and resp.id.startswith("resp-")
    assert resp.output_text == chat.choices[0].message.content
    assert resp.status == "incomplete"  # stopped at max_output_tokens
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and resp.usage.output_tokens == 8
    assert resp.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]


async def test_messages_and_instructions_become_the_chat_prompt(oai: AsyncOpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = await oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=40)  # type: ignore[arg-type]
    resp = await oai.responses.create(
        model=MODEL,
        instructions="be brief",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        max_output_tokens=40,
    )
    assert resp.output_text == chat.choices[0].message.content
    assert resp.output[0].type == "message" and resp.output[0].role == "assistant"


async def test_streamed_events_build_the_same_text(oai: AsyncOpenAI) -> None:
    whole = await oai.responses.create(model=MODEL, input="hey", max_output_tokens=8)
    stream = await oai.responses.create(model=MODEL, input="hey", max_output_tokens=8, stream=True)
    kinds, deltas, final = [], [], None
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert final is not None and final.output_text == "".join(deltas) == whole.output_text
    assert final.usage is not None and final.usage.output_tokens == 8


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp-1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search_preview"}]}, "tools"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ],
)
async def test_what_it_cannot_serve_is_a_400_naming_the_field(
    oai: AsyncOpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await oai.responses.create(model=MODEL, input="hey", extra_body=extra)
    assert param in str(info.value)
    ok = await oai.responses.create(model=MODEL, input="hey", max_output_tokens=2)
    assert ok.usage is not None and ok.usage.output_tokens == 2  # still serving


async def test_non_text_input_item_is_refused(oai: AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await oai.responses.create(
            model=MODEL, input=[{"type": "function_call_output", "call_id": "c", "output": "x"}]
        )
    assert "input[0]" in str(info.value)
