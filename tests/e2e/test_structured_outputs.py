"""Structured outputs, tool calls and the new sampling fields, with the official openai client,
on a colocated worker and through the router to a prefill/decode pair (random-weight model).

The demo model's weights are random: whatever it prefers, the grammar mask must still turn its
output into schema-valid JSON, and the decode leg must continue the prefill leg's grammar.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Literal

import aiohttp
import jsonschema
import openai
import pytest
import pytest_asyncio
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from .conftest import Cluster, Proc

MODEL = "demo"

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    },
    "enum_list": {
        "type": "array",
        "items": {"enum": ["red", "green", "blue"]},
        "minItems": 1,
        "maxItems": 3,
    },
    "nested": {
        "type": "object",
        "properties": {
            "kind": {"const": "point"},
            "xy": {
                "type": "array",
                "items": {"type": "integer", "minimum": -9, "maximum": 9},
                "minItems": 2,
                "maxItems": 2,
            },
            "tag": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}]},
        },
        "required": ["kind", "xy", "tag"],
        "additionalProperties": False,
    },
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "unit": {"enum": ["C", "F"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "maximum": 99, "minimum": 0},
                               "b": {"type": "integer", "maximum": 99, "minimum": 0}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]  # fmt: skip


@pytest.fixture(params=["colocated", "pd"])
def base_url(request: pytest.FixtureRequest) -> str:
    if request.param == "colocated":
        proc: Proc = request.getfixturevalue("colocated")
        return proc.url
    cluster: Cluster = request.getfixturevalue("pd_cluster")
    return cluster.router.url


@pytest_asyncio.fixture
async def oai(base_url: str) -> AsyncIterator[AsyncOpenAI]:
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120)
    try:
        yield client
    finally:
        await client.close()


def _messages(text: str = "Give me JSON.") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("seed", [None, 7])
async def test_json_schema_answers_validate(oai: AsyncOpenAI, name: str, seed: int | None):
    schema = SCHEMAS[name]
    sampling = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed, "n": 2}
    completion = await oai.chat.completions.create(
        model=MODEL,
        messages=_messages(),
        max_tokens=200,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True},
        },
        **sampling,
    )
    for choice in completion.choices:  # n=2: each choice advances its own matcher
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


class Weather(BaseModel):
    city: Annotated[str, Field(max_length=8)]
    unit: Literal["C", "F"]
    days: Annotated[int, Field(ge=1, le=7)]


async def test_openai_parse_with_a_pydantic_model(oai: AsyncOpenAI):
    # The client derives a strict json_schema (additionalProperties false, titles, ...).
    completion = await oai.chat.completions.parse(
        model=MODEL, messages=_messages(), max_tokens=100, temperature=0, response_format=Weather
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Weather) and 1 <= parsed.days <= 7


async def test_streamed_json_schema_validates_and_guided_fields_work(oai: AsyncOpenAI):
    schema = SCHEMAS["person"]
    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=_messages(),
        max_tokens=200,
        temperature=0.8,
        seed=3,
        stream=True,
        extra_body={"guided_json": schema},
    )
    text, finish = "", None
    async for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)
    choice = await oai.completions.create(
        model=MODEL,
        prompt="Pick one:",
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["alpha beta", "gamma"]}},
    )
    assert choice.choices[0].text in ("alpha beta", "gamma")
    regex = await oai.completions.create(
        model=MODEL, prompt="Date:", max_tokens=20, extra_body={"guided_regex": r"[0-9]{4}-0[1-9]"}
    )
    text = regex.choices[0].text
    assert len(text) == 7 and text[4] == "-" and text[:4].isdigit(), text
    gbnf = await oai.completions.create(
        model=MODEL, prompt="Answer:", max_tokens=20, temperature=0.9, seed=5,
        extra_body={"guided_grammar": 'root ::= ("yes" | "no") "!"'},
    )  # fmt: skip
    assert gbnf.choices[0].text in ("yes!", "no!") and gbnf.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
async def test_required_and_named_tool_choices_come_back_as_tool_calls(
    oai: AsyncOpenAI, stream: bool
):
    for tool_choice in ("required", {"type": "function", "function": {"name": "add"}}):
        kwargs = {"model": MODEL, "messages": _messages("What is 2+3?"), "tools": TOOLS,
                  "tool_choice": tool_choice, "max_tokens": 150, "temperature": 0.0,
                  "parallel_tool_calls": False}  # fmt: skip
        if stream:
            async with oai.chat.completions.stream(**kwargs) as s:
                async for _ in s:
                    pass
                completion = await s.get_final_completion()
        else:
            completion = await oai.chat.completions.create(**kwargs)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
        assert calls and all(c.type == "function" and c.id for c in calls)
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in calls] == ["add"]


async def test_tool_results_go_back_into_the_conversation(oai: AsyncOpenAI):
    completion = await oai.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21"},
        ],
        tools=TOOLS,
        max_tokens=4,
    )  # fmt: skip
    assert completion.choices[0].finish_reason in ("length", "stop", "tool_calls")


async def test_logit_bias_and_min_tokens_change_what_they_must(oai: AsyncOpenAI, base_url: str):
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base_url}/tokenize", json={"prompt": " forced"}) as resp:
            assert resp.status == 200
            tokenized = await resp.json()
        token = tokenized["tokens"][-1]
        async with http.post(f"{base_url}/detokenize", json={"tokens": tokenized["tokens"]}) as r:
            assert (await r.json())["prompt"].endswith(" forced")
        async with http.post(f"{base_url}/detokenize", json={"tokens": [token]}) as r:
            token_text = (await r.json())["prompt"]
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] > 0
    biased = await oai.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logit_bias={str(token): 100}
    )
    assert biased.choices[0].text == token_text * 4
    # With EOS banned outright, min_tokens is what stands between the model and an early stop.
    eos_heavy = await oai.completions.create(
        model=MODEL, prompt="Hello", max_tokens=6, temperature=0,
        extra_body={"stop_token_ids": [token], "min_tokens": 6}, logit_bias={str(token): 100},
    )  # fmt: skip
    assert eos_heavy.usage.completion_tokens == 6 and eos_heavy.choices[0].finish_reason == "length"
    stopped = await oai.completions.create(
        model=MODEL, prompt="Hello", max_tokens=6, temperature=0,
        extra_body={"stop_token_ids": [token]}, logit_bias={str(token): 100},
    )  # fmt: skip
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"


HOSTILE = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nonsense"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20000)}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "a("}, "guided_regex"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias.99999999"),
    ({"logit_bias": {"1": 101}}, "logit_bias.1"),
    ({"logit_bias": {"-1": 1}}, "logit_bias.-1"),
    ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"min_p": 1.5}, "min_p"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"continue_final_message": True}, "continue_final_message"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), HOSTILE)
async def test_hostile_fields_are_400s_naming_the_field(oai: AsyncOpenAI, fields: dict, param: str):
    with pytest.raises(openai.BadRequestError) as info:
        await oai.chat.completions.create(
            model=MODEL, messages=_messages(), max_tokens=3, extra_body=fields
        )
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == param, body
    again = await oai.chat.completions.create(model=MODEL, messages=_messages(), max_tokens=2)
    assert again.choices[0].finish_reason in ("length", "stop")


async def test_echo_with_logprobs_scores_the_prompt_on_a_colocated_worker(
    colocated: Proc, pd_cluster: Cluster
):
    async with AsyncOpenAI(base_url=f"{colocated.url}/v1", api_key="x", max_retries=0) as client:
        out = await client.completions.create(
            model=MODEL, prompt="one two three", max_tokens=3, temperature=0, echo=True,
            logprobs=2,
        )  # fmt: skip
        choice = out.choices[0]
        lp = choice.logprobs
        num_prompt = out.usage.prompt_tokens
        assert choice.text.startswith("one two three")
        assert len(lp.tokens) == num_prompt + 3 and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None
        assert all(v <= 0 for v in lp.token_logprobs[1:])
        # The top 2, plus the chosen token where it is not among them (as OpenAI and vLLM).
        assert all(len(t) in (2, 3) for t in lp.top_logprobs[1:])
        chosen = zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True)
        assert all(tok in top for tok, top in chosen)
        # Greedy: each generated token is its own position's best.
        for i in range(num_prompt, num_prompt + 3):
            assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()))
    base = f"{pd_cluster.router.url}/v1"
    async with AsyncOpenAI(base_url=base, api_key="x", max_retries=0) as client:
        # Through the router, prompt scoring goes to a worker that prefills it itself.
        scored = await client.completions.create(
            model=MODEL, prompt="one two three", max_tokens=3, temperature=0, echo=True,
            logprobs=2,
        )  # fmt: skip
        assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs
        echoed = await client.completions.create(model=MODEL, prompt="abc", max_tokens=2, echo=True)
        assert echoed.choices[0].text.startswith("abc")
