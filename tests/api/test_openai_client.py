"""The official openai client against a really bound server (streaming and not)."""

from __future__ import annotations

import openai
import pytest
from openai import AsyncOpenAI

from pdserve.api import ApiConfig

from .conftest import API_KEY, make_config
from .engine_double import MODEL, FakeEngine


@pytest.fixture
def config() -> ApiConfig:
    return make_config(api_key=API_KEY)


async def test_chat_completion(oai: AsyncOpenAI) -> None:
    completion = await oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hey"}], max_tokens=6, n=2, seed=1
    )
    assert [c.index for c in completion.choices] == [0, 1]
    assert all(
        c.message.content == "<user>" and c.message.role == "assistant" for c in completion.choices
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 12


async def test_streamed_chat_with_usage(oai: AsyncOpenAI) -> None:
    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hey"}],
        max_completion_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, finish, usage, roles = "", None, None, []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert roles[0] == "assistant" and content == "<user>he" and finish == "length"
    assert usage is not None and usage.completion_tokens == 8
    assert usage.total_tokens == usage.prompt_tokens + 8


async def test_chat_logprobs(oai: AsyncOpenAI) -> None:
    completion = await oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    entries = completion.choices[0].logprobs.content
    assert [e.token for e in entries] == ["<", "u", "s"]
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in entries)


async def test_completion_with_stop_and_logprobs(oai: AsyncOpenAI) -> None:
    completion = await oai.completions.create(
        model=MODEL, prompt="one two three", max_tokens=13, stop=[" three"], logprobs=2
    )
    (choice,) = completion.choices
    assert choice.text == "one two" and choice.finish_reason == "stop"
    assert choice.logprobs.tokens[:3] == ["o", "n", "e"]
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)


async def test_streamed_completion_batch(oai: AsyncOpenAI) -> None:
    stream = await oai.completions.create(
        model=MODEL, prompt=["ab", "cd"], max_tokens=4, stream=True
    )
    texts = {0: "", 1: ""}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: "abab", 1: "cdcd"}


async def test_errors_raise_the_clients_typed_exceptions(
    oai: AsyncOpenAI, live_url: str, engine: FakeEngine
) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        await oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        await oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    assert bad.value.param == "temperature"
    wrong_key = AsyncOpenAI(base_url=f"{live_url}/v1", api_key="nope", max_retries=0, timeout=10)
    try:
        with pytest.raises(openai.AuthenticationError):
            await wrong_key.models.list()
    finally:
        await wrong_key.close()


async def test_models_list(oai: AsyncOpenAI) -> None:
    models = await oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (await oai.models.retrieve(MODEL)).id == MODEL
