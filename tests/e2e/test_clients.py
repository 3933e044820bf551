"""What real clients send, on a colocated worker and through the router to a PD pair (demo model):
guidellm's streaming body, instructor's and langchain's schemas, lm-eval's prompt-scoring
bodies (recorded from the real clients by ``bench/clients.py --record``, replayed from
tests/data/clients/), and the vLLM fields they rely on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from .conftest import Cluster, Proc

MODEL = "demo"
DATA = Path(__file__).resolve().parents[1] / "data" / "clients"


def recorded(name: str) -> dict[str, Any]:
    body = json.loads((DATA / name).read_text())
    body["model"] = MODEL
    return body


async def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(url + path, json=body) as resp,
    ):
        raw = await resp.read()
        if resp.content_type == "text/event-stream":
            events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
            assert events[-1] == b"[DONE]", raw[-300:]
            return resp.status, [json.loads(e) for e in events[:-1]]
        return resp.status, json.loads(raw)


@pytest.fixture(params=["colocated", "pd"])
def url(request: pytest.FixtureRequest) -> str:
    if request.param == "colocated":
        proc: Proc = request.getfixturevalue("colocated")
        return proc.url
    cluster: Cluster = request.getfixturevalue("pd_cluster")
    return cluster.router.url


@pytest.mark.parametrize("name", ["guidellm-chat.json", "guidellm-completions.json"])
async def test_guidellm_streaming_body_gets_usage_on_every_chunk(url: str, name: str) -> None:
    body = recorded(name)
    assert body["stream_options"]["continuous_usage_stats"] is True  # what guidellm sends
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body.pop("max_completion_tokens", None)  # 8 tokens, not guidellm's 64: the test is faster
    status, chunks = await post(url, path, {**body, "max_tokens": 8})
    assert status == 200, chunks
    assert all(c["usage"] is not None for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 8


ORDERED = {
    "type": "object",
    "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "boolean"}, "mid": {"const": 1}},
    "required": ["zeta", "alpha", "mid"],
}


async def test_schema_keys_come_in_declared_order(url: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": ORDERED}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "seed": 1,
            "max_tokens": 40, "response_format": fmt}  # fmt: skip
    status, out = await post(url, "/v1/chat/completions", body)
    assert status == 200, out
    text = out["choices"][0]["message"]["content"]
    assert list(json.loads(text)) == ["zeta", "alpha", "mid"], text


@pytest.mark.parametrize(
    "name",
    ["instructor-json_schema.json", "instructor-tools.json", "langchain-json_schema.json",
     "langchain-tools.json"],
)  # fmt: skip
async def test_client_schemas_hold_only_declared_keys(url: str, name: str) -> None:
    # pydantic schemas never say additionalProperties (langchain's strict json_schema adds it):
    # no undeclared key may open, on any seed.
    body = recorded(name)
    for seed in range(3):
        status, out = await post(url, "/v1/chat/completions", {**body, "seed": seed, "n": 1})
        assert status == 200, out
        choice = out["choices"][0]
        text, declared = _output_and_keys(body, choice["message"])
        assert set(json.loads(text)) <= declared, choice
        assert choice["finish_reason"] in ("stop", "tool_calls"), choice


def _output_and_keys(body: dict[str, Any], message: dict[str, Any]) -> tuple[str, set[str]]:
    """The JSON the schema constrained, and the keys its schema declares."""
    if "tools" not in body:
        schema = body["response_format"]["json_schema"]["schema"]
        return message["content"], set(schema["properties"])
    call = message["tool_calls"][0]["function"]
    tool = next(t for t in body["tools"] if t["function"]["name"] == call["name"])
    return call["arguments"], set(tool["function"]["parameters"]["properties"])


async def test_lm_eval_scoring_bodies_are_equal_on_pd_and_colocated(
    colocated: Proc, pd_cluster: Cluster
) -> None:
    body = recorded("lm_eval-completions.json")
    assert body["echo"] is True and body["logprobs"] == 1  # lm-eval's loglikelihood request
    status, colo = await post(colocated.url, "/v1/completions", body)
    assert status == 200, colo
    status, pd = await post(pd_cluster.router.url, "/v1/completions", body)
    assert status == 200, pd
    for c, p in zip(colo["choices"], pd["choices"], strict=True):
        # Served whole by the decode, which runs the colocated worker's code with the same
        # reduction order whatever the batch (docs/architecture.md "Numerics"): bit for bit.
        assert c["logprobs"]["token_logprobs"] == p["logprobs"]["token_logprobs"]
        assert c["logprobs"]["top_logprobs"] == p["logprobs"]["top_logprobs"]
        lp = c["logprobs"]
        rows = zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
        for token, logprob, top in rows:
            assert top is None or top[token] == logprob  # the chosen token is always listed


async def test_lm_eval_generate_body_is_served_alike(colocated: Proc, pd_cluster: Cluster) -> None:
    body = recorded("lm_eval-generate.json")  # greedy, token-id prompt, stop strings
    status, colo = await post(colocated.url, "/v1/completions", body)
    assert status == 200, colo
    status, pd = await post(pd_cluster.router.url, "/v1/completions", body)
    assert status == 200, pd
    assert colo["choices"][0]["text"] == pd["choices"][0]["text"]


async def test_token_id_echo_agrees_with_tokens_and_offsets(colocated: Proc) -> None:
    status, out = await post(colocated.url, "/v1/completions", {
        "model": MODEL, "prompt": [1, 300, 301, 302], "echo": True, "logprobs": 0,
        "max_tokens": 0})  # fmt: skip
    assert status == 200, out
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 4 and out["usage"]["completion_tokens"] == 0
    assert "".join(lp["tokens"]) == choice["text"]  # <s> counted in text and offsets alike
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert choice["text"][offset : offset + len(token)] == token


async def test_chat_prompt_logprobs_on_pd(pd_cluster: Cluster) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "prompt_logprobs": 1}  # fmt: skip
    status, out = await post(pd_cluster.router.url, "/v1/chat/completions", body)
    assert status == 200, out
    entries = out["prompt_logprobs"]
    assert entries[0] is None and all(len(e) in (1, 2) for e in entries[1:])


async def test_stop_string_kept_when_asked(colocated: Proc) -> None:
    base = {"model": MODEL, "prompt": "a b c", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    status, out = await post(colocated.url, "/v1/completions", base)
    text = out["choices"][0]["text"]
    stop = text[3:5] if len(text) >= 5 else text[-1:]
    assert stop
    status, cut = await post(colocated.url, "/v1/completions", {**base, "stop": [stop]})
    status, kept = await post(
        colocated.url,
        "/v1/completions",
        {**base, "stop": [stop], "include_stop_str_in_output": True},
    )
    assert kept["choices"][0]["text"] == cut["choices"][0]["text"] + stop


async def test_cache_salt_isolates_the_prefix_cache(colocated: Proc) -> None:
    prompt = list(range(300, 300 + 80))  # five full pages
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}

    async def cached(**extra: Any) -> int:
        status, out = await post(colocated.url, "/v1/completions", {**body, **extra})
        assert status == 200, out
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]

    await cached(cache_salt="tenant-a")
    assert await cached(cache_salt="tenant-a") > 0  # the same tenant finds its pages
    assert await cached(cache_salt="tenant-b") == 0  # another tenant does not
    assert await cached() == 0  # nor an unsalted request


async def test_responses_output_text_is_the_chat_answer(url: str) -> None:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    async with client:
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
        )
        resp = await client.responses.create(
            model=MODEL, input="hi", max_output_tokens=8, temperature=0
        )
        stream = await client.responses.create(
            model=MODEL, input="hi", max_output_tokens=8, temperature=0, stream=True
        )
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
    assert resp.output_text == chat.choices[0].message.content == "".join(deltas)


async def test_responses_through_the_router_run_on_both_legs(pd_cluster: Cluster) -> None:
    client = AsyncOpenAI(
        base_url=f"{pd_cluster.router.url}/v1", api_key="unused", max_retries=0, timeout=120
    )
    async with client:
        resp = await client.responses.create(model=MODEL, input="hello", max_output_tokens=4)
    assert resp.usage is not None and resp.usage.output_tokens == 4
    async with (
        aiohttp.ClientSession() as session,
        session.get(pd_cluster.prefill.url + "/metrics") as r,
    ):
        metrics = await r.text()
    served = 'pdserve_http_requests_total{endpoint="/v1/responses",status="200"}'
    assert served in metrics  # the prefill leg computed the prompt's KV
