"""Fixtures: the app over aiohttp's in-process test client, and a really bound server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI
from prometheus_client import CollectorRegistry

from pdserve.api import ApiConfig, build_app, start_http

from .engine_double import MODEL, FakeEngine

API_KEY = "test-key"


def make_config(**overrides: object) -> ApiConfig:
    return ApiConfig(served_model_name=MODEL, **overrides)  # type: ignore[arg-type]


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``predicate`` until true; fail the test at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(0.005)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def config() -> ApiConfig:
    return make_config()


@pytest_asyncio.fixture
async def client(engine: FakeEngine, config: ApiConfig) -> AsyncIterator[TestClient]:
    """aiohttp test client on the app (TestServer enables handler cancellation)."""
    app = build_app(engine, config, CollectorRegistry())
    async with TestClient(TestServer(app, host="127.0.0.1")) as test_client:
        yield test_client


@pytest_asyncio.fixture
async def live_url(engine: FakeEngine, config: ApiConfig) -> AsyncIterator[str]:
    """Base URL of the app served by start_http on 127.0.0.1, ephemeral port."""
    runner, port = await start_http(build_app(engine, config, CollectorRegistry()), "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest_asyncio.fixture
async def oai(live_url: str) -> AsyncIterator[AsyncOpenAI]:
    """The official openai client on the live server (no retries: a failure shows at once)."""
    client = AsyncOpenAI(base_url=f"{live_url}/v1", api_key=API_KEY, max_retries=0, timeout=10)
    try:
        yield client
    finally:
        await client.close()


def chat_body(content: str = "hello", **fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


def completion_body(prompt: object = "hello", **fields: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, **fields}


def assert_openai_error(payload: dict, param: str | None = None) -> dict:
    """The body is exactly an OpenAI error object; returns its inner dict."""
    assert set(payload) == {"error"}
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param
    return error
