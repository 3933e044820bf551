"""Hostile and broken input: the right 4xx with an OpenAI error body, then business as usual."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp.test_utils import TestClient

from pdserve.api import ApiConfig

from .conftest import assert_openai_error, chat_body, completion_body, make_config
from .engine_double import MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_BODY = 4096


@pytest.fixture
def config() -> ApiConfig:
    return make_config(max_body_bytes=MAX_BODY, max_n=8)


def case(
    name: str,
    path: str,
    body: object,
    status: int = 400,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> object:
    """One hostile request; ``body`` is sent as is when bytes, else JSON-encoded."""
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return pytest.param(path, raw, headers or {}, status, param, code, id=name)


C = chat_body
P = completion_body
CASES = [
    case("malformed-json", CHAT, b'{"model": "fake-model", "messages": [', code="invalid_json"),
    case("invalid-utf8", CHAT, b'{"model": "fake-model\xff"}', code="invalid_encoding"),
    case("not-an-object", CHAT, b"[1, 2, 3]", code="invalid_json"),
    case("nan-literal", CHAT, b'{"model": "fake-model", "temperature": NaN}'),
    case("infinite-number", CHAT, b'{"model": "fake-model", "top_p": 1e999}'),
    case("messages-wrong-type", CHAT, {"model": MODEL, "messages": "hi"}, param="messages"),
    case("missing-messages", CHAT, {"model": MODEL}, param="messages"),
    case("max-tokens-string", CHAT, C(max_tokens="5"), param="max_tokens", code="invalid_type"),
    case("stream-int", CHAT, C(stream=1), param="stream", code="invalid_type"),
    case("empty-prompt", COMPLETIONS, P(""), param="prompt"),
    case("empty-prompt-list", COMPLETIONS, P([]), param="prompt"),
    case("prompt-over-window", COMPLETIONS, P("x" * 200), code="context_length_exceeded"),
    case("max-tokens-zero", CHAT, C(max_tokens=0), param="max_tokens"),
    case("max-tokens-negative", COMPLETIONS, P(max_tokens=-1), param="max_tokens"),
    case("max-tokens-over-window", COMPLETIONS, P(max_tokens=1000), code="context_length_exceeded"),
    case("temperature-negative", CHAT, C(temperature=-0.5), param="temperature"),
    case("top-p-zero", CHAT, C(top_p=0), param="top_p"),
    case("top-p-above-one", COMPLETIONS, P(top_p=1.5), param="top_p"),
    case("top-k-below-minus-one", CHAT, C(top_k=-2), param="top_k"),
    case("huge-n", CHAT, C(n=10_000), param="n"),
    case("too-many-stops", CHAT, C(stop=[f"s{i}" for i in range(17)]), param="stop"),
    case("stop-too-long", CHAT, C(stop=["x" * 300]), param="stop[0]"),
    case("unknown-model", CHAT, {**C(), "model": "gpt-4o"}, 404, "model", "model_not_found"),
    case("unknown-field", CHAT, C(frobnicate=True), param="frobnicate"),
    case(
        "tool-name",
        CHAT,
        C(tools=[{"type": "function", "function": {"name": "f g"}}]),
        param="tools[0].function.name",
    ),
    case("tool-choice", CHAT, C(tool_choice="required"), param="tool_choice"),
    case("json-mode", CHAT, C(response_format={"type": "json_object"}), param="response_format"),
    case("logit-bias", COMPLETIONS, P(logit_bias={"999": 10}), param="logit_bias.999"),
    case("min-tokens-over-max", COMPLETIONS, P(min_tokens=5, max_tokens=2), param="min_tokens"),
    case("best-of", COMPLETIONS, P(best_of=3), param="best_of"),
    case("suffix", COMPLETIONS, P(suffix="end"), param="suffix"),
    case("token-out-of-vocab", COMPLETIONS, P([1, 99999]), param="prompt"),
    case("bad-request-id", CHAT, C(), param="X-Request-Id", headers={"X-Request-Id": "bad id!"}),
    case(
        "bad-kv-params",
        CHAT,
        C(kv_transfer_params={"room_id": "r"}),
        param="kv_transfer_params.bootstrap_host",
    ),
    case("body-too-large", CHAT, C("x" * (MAX_BODY + 10)), 413, code="request_too_large"),
]


async def _good_request_succeeds(client: TestClient) -> None:
    resp = await client.post(CHAT, json=chat_body("ok", max_tokens=2))
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["message"]["content"] == "<u"


@pytest.mark.parametrize("path, raw, headers, status, param, code", CASES)
async def test_hostile_body_gets_an_openai_error_and_the_server_keeps_serving(
    client: TestClient,
    path: str,
    raw: bytes,
    headers: dict[str, str],
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    resp = await client.post(
        path, data=raw, headers={"Content-Type": "application/json", **headers}
    )
    assert resp.status == status, await resp.text()
    assert resp.headers["Content-Type"].startswith("application/json")
    error = assert_openai_error(await resp.json(), param)
    if code is not None:
        assert error["code"] == code
    await _good_request_succeeds(client)


async def test_chunked_upload_over_the_limit_is_413(client: TestClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(8):
            yield b" " * 1024  # no Content-Length: the limit must hold while reading

    resp = await client.post(CHAT, data=chunks())
    assert resp.status == 413
    assert assert_openai_error(await resp.json())["code"] == "request_too_large"
    await _good_request_succeeds(client)


async def test_numbers_are_stated_in_window_errors(client: TestClient) -> None:
    resp = await client.post(COMPLETIONS, json=completion_body("abcdefghij", max_tokens=200))
    message = (await resp.json())["error"]["message"]
    assert "maximum context length is 128 tokens" in message
    assert "210 tokens (10 in the prompt, 200 in the completion)" in message
