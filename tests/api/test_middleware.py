from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from pdserve.api import build_app

from .conftest import API_KEY, assert_openai_error, chat_body, make_config
from .engine_double import FakeEngine


@pytest_asyncio.fixture
async def keyed_client(engine: FakeEngine) -> AsyncIterator[TestClient]:
    app = build_app(engine, make_config(api_key=API_KEY), CollectorRegistry())
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", API_KEY, "Bearer  " + API_KEY])
async def test_missing_or_wrong_api_key_is_401(
    keyed_client: TestClient, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    resp = await keyed_client.post("/v1/chat/completions", json=chat_body(), headers=headers)
    assert resp.status == 401
    assert resp.headers["WWW-Authenticate"] == "Bearer"
    assert assert_openai_error(await resp.json())["code"] == "invalid_api_key"
    for path in ("/v1/models", "/v1/models/fake-model"):
        assert (await keyed_client.get(path, headers=headers)).status == 401


async def test_right_api_key_is_served(keyed_client: TestClient) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    resp = await keyed_client.post("/v1/chat/completions", json=chat_body(), headers=headers)
    assert resp.status == 200


async def test_probes_stay_open_and_admin_paths_answer_loopback_without_an_admin_key(
    keyed_client: TestClient,
) -> None:
    for path in ("/health", "/health/ready", "/server_info", "/metrics", "/debug/requests"):
        assert (await keyed_client.get(path)).status == 200, path


async def test_no_key_configured_means_no_auth(client: TestClient) -> None:
    assert (await client.post("/v1/chat/completions", json=chat_body())).status == 200


async def test_wrong_method_and_unknown_path_get_openai_errors(client: TestClient) -> None:
    wrong_method = await client.get("/v1/chat/completions")
    assert wrong_method.status == 405 and wrong_method.headers["Allow"] == "POST"
    assert assert_openai_error(await wrong_method.json())["code"] == "method_not_allowed"
    missing = await client.post("/v2/chat")
    assert missing.status == 404
    assert assert_openai_error(await missing.json())["code"] == "not_found"


class _BrokenReadiness(FakeEngine):
    def is_ready(self) -> bool:
        raise RuntimeError("readiness probe exploded")


async def test_unexpected_exception_is_a_generic_500_logged_and_serving_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = build_app(_BrokenReadiness(), make_config(), CollectorRegistry())
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        with caplog.at_level(logging.ERROR, logger="pdserve.api.middleware"):
            resp = await client.get("/health/ready")
        assert resp.status == 500
        error = assert_openai_error(await resp.json())
        assert error["type"] == "server_error"
        assert "exploded" not in error["message"]  # no internals to the client
        assert any("readiness probe exploded" in (r.exc_text or "") for r in caplog.records)
        assert (await client.get("/health")).status == 200
        assert (await client.post("/v1/chat/completions", json=chat_body())).status == 200
