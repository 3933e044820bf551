"""Handler-level tests of the OpenAI endpoints through aiohttp's test client."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient

from pdserve.engine.protocol import EngineError

from .conftest import assert_openai_error, chat_body, completion_body
from .engine_double import MODEL, FakeEngine, fake_logprob
from .sse_utils import parse_sse


async def test_chat_completion_echoes_the_templated_prompt(
    client: TestClient, engine: FakeEngine
) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body("hi", max_tokens=9))
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-") and resp.headers["X-Request-Id"] == body["id"]
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "<user>hi\n"}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    prompt_len = len("<user>hi\n<assistant>")
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 9,
        "total_tokens": prompt_len + 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert engine.requests[0].request_id == body["id"]


async def test_completion_batch_with_n_orders_choices_prompt_major(client: TestClient) -> None:
    resp = await client.post(
        "/v1/completions",
        json=completion_body(["ab", "xyz"], n=2, max_tokens=3),
        headers={"X-Request-Id": "batch-1"},
    )
    body = await resp.json()
    assert body["id"] == "batch-1"
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "aba"),
        (1, "aba"),
        (2, "xyz"),
        (3, "xyz"),
    ]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 12


async def test_token_id_prompt_and_stop_string(client: TestClient) -> None:
    resp = await client.post(
        "/v1/completions", json=completion_body(list(b"hello world"), max_tokens=11, stop=[" w"])
    )
    (choice,) = (await resp.json())["choices"]
    assert choice["text"] == "hello" and choice["finish_reason"] == "stop"


async def test_streamed_chat_chunks_then_done(client: TestClient) -> None:
    resp = await client.post(
        "/v1/chat/completions",
        json=chat_body("ok", max_tokens=4, stream=True, stream_options={"include_usage": True}),
    )
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events, is_done = parse_sse(await resp.read())
    assert is_done
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert content == "<use"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert len({e["id"] for e in events}) == 1


async def test_streamed_completion_with_n_tags_every_chunk_with_its_index(
    client: TestClient,
) -> None:
    resp = await client.post(
        "/v1/completions", json=completion_body("abc", n=3, max_tokens=6, stream=True)
    )
    events, is_done = parse_sse(await resp.read())
    assert is_done
    texts = ["", "", ""]
    for event in events:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
        assert "usage" not in event
    assert texts == ["abcabc"] * 3


async def test_logprobs_shapes(client: TestClient) -> None:
    chat = await client.post(
        "/v1/chat/completions", json=chat_body("x", max_tokens=2, logprobs=True, top_logprobs=2)
    )
    content = (await chat.json())["choices"][0]["logprobs"]["content"]
    assert [set(e) for e in content] == [{"token", "logprob", "bytes", "top_logprobs"}] * 2
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    legacy = await client.post(
        "/v1/completions", json=completion_body("ab", max_tokens=2, logprobs=1)
    )
    block = (await legacy.json())["choices"][0]["logprobs"]
    assert block["tokens"] == ["a", "b"] and block["text_offset"] == [0, 1]
    expected = [fake_logprob(t, 1) for t in b"ab"]
    assert block["token_logprobs"] == [e.logprob for e in expected]
    assert block["top_logprobs"] == [{chr(e.top[0][0]): e.top[0][1]} for e in expected]


async def test_kv_transfer_params_reach_the_engine_per_choice(
    client: TestClient, engine: FakeEngine
) -> None:
    kv = {"room_id": "room-1", "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}
    headers = {"X-Request-Id": "pd-1"}
    await client.post(
        "/v1/completions", json=completion_body("a", n=2, kv_transfer_params=kv), headers=headers
    )
    rooms = [(r.request_id, r.kv_transfer.room_id) for r in engine.requests]
    assert rooms == [("pd-1-0", "room-1-0"), ("pd-1-1", "room-1-1")]


async def test_engine_error_before_output_keeps_its_status(
    client: TestClient, engine: FakeEngine
) -> None:
    engine.fail_error = EngineError(
        "kv wait timed out", status=504, err_type="timeout", code="timeout:waiting_for_kv"
    )
    for stream in (False, True):
        resp = await client.post("/v1/chat/completions", json=chat_body("a", stream=stream))
        assert resp.status == 504
        error = assert_openai_error(await resp.json())
        assert error["code"] == "timeout:waiting_for_kv" and error["type"] == "timeout"


async def test_engine_error_mid_stream_is_an_sse_error_then_done(
    client: TestClient, engine: FakeEngine
) -> None:
    engine.fail_error = EngineError("decode peer lost", status=503, code="peer_lost")
    engine.fail_after = 2
    resp = await client.post("/v1/completions", json=completion_body("abcd", stream=True))
    assert resp.status == 200
    events, is_done = parse_sse(await resp.read())
    assert is_done
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "ab"
    error = assert_openai_error(events[-1])
    assert error["message"] == "decode peer lost" and error["code"] == "peer_lost"


async def test_engine_error_in_one_choice_aborts_the_others(
    client: TestClient, engine: FakeEngine
) -> None:
    engine.fail_error = EngineError("boom", status=503)
    engine.fail_after = 1
    engine.fail_ids = {"f-1"}
    engine.hang_after = 1  # f-0 waits here until something aborts it
    async with asyncio.timeout(5):
        resp = await client.post(
            "/v1/completions", json=completion_body("ab", n=2), headers={"X-Request-Id": "f"}
        )
    assert resp.status == 503
    assert engine.aborted_ids() == {"f-0"} and engine.live == {}


async def test_models_listing_and_retrieval(client: TestClient) -> None:
    listing = await (await client.get("/v1/models")).json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == [MODEL]
    assert listing["data"][0]["max_model_len"] == 128
    assert (await client.get(f"/v1/models/{MODEL}")).status == 200
    missing = await client.get("/v1/models/other")
    assert missing.status == 404
    assert assert_openai_error(await missing.json())["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
async def test_temperature_zero_with_seed_is_accepted(client: TestClient, stream: bool) -> None:
    resp = await client.post(
        "/v1/chat/completions", json=chat_body("a", temperature=0, seed=3, stream=stream)
    )
    assert resp.status == 200
    await resp.read()
