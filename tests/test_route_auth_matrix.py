"""Every route of the worker app and of the router app, called with no key, a client key, the
admin key and the registration token: the status of each cell, from one table per app. The
tables are checked against ``app.router.routes()``, so a route added without a row fails here
(and the app itself refuses to start with a route missing from its access table)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from pdserve.api import build_app
from pdserve.router import Router
from tests.api.conftest import chat_body, completion_body, make_config
from tests.api.engine_double import MODEL, FakeEngine
from tests.router.conftest import TEST_CONFIG, FakeWorker, KVBoard

CLIENT_KEY, ADMIN_KEY, REGISTRATION_TOKEN = "client-key", "admin-key", "registration-token"
CREDENTIALS = {"none": None, "client": CLIENT_KEY, "admin": ADMIN_KEY, "token": REGISTRATION_TOKEN}
COLUMNS = tuple(CREDENTIALS)
# (method, route template) -> (path to call, request kwargs, status per COLUMNS cell)
Row = tuple[str, dict[str, Any], tuple[int, int, int, int]]

# A worker knows no registration token: to it, the token is just a wrong key (401).
WORKER_TABLE: dict[tuple[str, str], Row] = {
    ("POST", "/v1/chat/completions"): ("", {"json": chat_body()}, (401, 200, 403, 401)),
    ("POST", "/v1/completions"): ("", {"json": completion_body()}, (401, 200, 403, 401)),
    ("POST", "/v1/responses"): (
        "",
        {"json": {"model": MODEL, "input": "hi"}},
        (401, 200, 403, 401),
    ),
    ("POST", "/tokenize"): ("", {"json": {"model": MODEL, "prompt": "hi"}}, (401, 200, 403, 401)),
    ("POST", "/detokenize"): (
        "",
        {"json": {"model": MODEL, "tokens": [104]}},
        (401, 200, 403, 401),
    ),
    ("GET", "/v1/models"): ("", {}, (401, 200, 403, 401)),
    ("GET", "/v1/models/{model}"): (f"/v1/models/{MODEL}", {}, (401, 200, 403, 401)),
    ("GET", "/health"): ("", {}, (200, 200, 200, 200)),
    ("HEAD", "/health"): ("", {}, (200, 200, 200, 200)),
    ("GET", "/health/ready"): ("", {}, (200, 200, 200, 200)),
    ("HEAD", "/health/ready"): ("", {}, (200, 200, 200, 200)),
    ("GET", "/server_info"): ("", {}, (200, 200, 200, 200)),
    ("GET", "/metrics"): ("", {}, (401, 403, 200, 401)),
    ("GET", "/debug/requests"): ("", {}, (401, 403, 200, 401)),
    ("GET", "/debug/rooms"): ("", {}, (401, 403, 200, 401)),
    # A client may abort only a request its key started (none is live): 404, as for any id.
    ("POST", "/abort/{request_id}"): ("/abort/nope", {}, (401, 404, 200, 401)),
    ("POST", "/drain"): ("", {}, (401, 403, 202, 401)),
}

REGISTER_BODY = {"url": "nope"}  # reaches the handler only with the token: a 400 naming url
ROUTER_TABLE: dict[tuple[str, str], Row] = {
    ("POST", "/v1/chat/completions"): ("", {"json": chat_body()}, (401, 200, 403, 403)),
    ("POST", "/v1/completions"): ("", {"json": completion_body()}, (401, 200, 403, 403)),
    ("POST", "/v1/responses"): ("", {"data": b"{nope"}, (401, 400, 403, 403)),
    ("GET", "/v1/models"): ("", {}, (401, 200, 403, 403)),
    ("HEAD", "/v1/models"): ("", {}, (401, 200, 403, 403)),
    ("POST", "/tokenize"): ("", {"json": {"model": MODEL, "prompt": "hi"}}, (401, 200, 403, 403)),
    ("POST", "/detokenize"): ("", {"json": {"tokens": [1]}}, (401, 200, 403, 403)),
    ("GET", "/health"): ("", {}, (200, 200, 200, 200)),
    ("HEAD", "/health"): ("", {}, (200, 200, 200, 200)),
    ("GET", "/health/ready"): ("", {}, (200, 200, 200, 200)),
    ("HEAD", "/health/ready"): ("", {}, (200, 200, 200, 200)),
    ("GET", "/health/pd"): ("", {}, (200, 200, 200, 200)),
    ("HEAD", "/health/pd"): ("", {}, (200, 200, 200, 200)),
    ("GET", "/metrics"): ("", {}, (401, 403, 200, 403)),
    ("HEAD", "/metrics"): ("", {}, (401, 403, 200, 403)),
    ("POST", "/abort/{request_id}"): ("/abort/nope", {}, (401, 404, 200, 403)),
    ("GET", "/workers"): ("", {}, (401, 403, 200, 403)),
    ("HEAD", "/workers"): ("", {}, (401, 403, 200, 403)),
    ("POST", "/workers"): ("", {"json": {"role": "decode"}}, (401, 403, 400, 403)),
    ("DELETE", "/workers"): ("", {}, (401, 403, 400, 403)),
    ("POST", "/workers/register"): ("", {"json": REGISTER_BODY}, (401, 403, 403, 400)),
    ("POST", "/workers/deregister"): ("", {"json": REGISTER_BODY}, (401, 403, 403, 400)),
    ("GET", "/debug/requests"): ("", {}, (401, 403, 200, 403)),
    ("HEAD", "/debug/requests"): ("", {}, (401, 403, 200, 403)),
}


def routes_of(app: web.Application) -> set[tuple[str, str]]:
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}


def headers(column: str) -> dict[str, str]:
    key = CREDENTIALS[column]
    return {"Authorization": f"Bearer {key}"} if key else {}


def worker_app() -> web.Application:
    config = make_config(api_key=CLIENT_KEY, admin_api_key=ADMIN_KEY)
    return build_app(FakeEngine(), config, CollectorRegistry())


def test_every_worker_route_has_a_row_and_every_row_a_route() -> None:
    assert routes_of(worker_app()) == set(WORKER_TABLE)


def test_an_app_with_a_route_missing_from_its_access_table_does_not_build(monkeypatch) -> None:
    from pdserve.api import app as api_app

    table = {k: v for k, v in api_app.ROUTE_ACCESS.items() if k != "/drain"}
    monkeypatch.setattr(api_app, "ROUTE_ACCESS", table)
    with pytest.raises(RuntimeError, match="/drain"):
        worker_app()


@pytest.mark.parametrize("route", sorted(WORKER_TABLE), ids="{0[0]} {0[1]}".format)
async def test_worker_route_answers_each_credential_as_its_table_row_says(route) -> None:
    method, template = route
    path, kwargs, expected = WORKER_TABLE[route]
    got = []
    for column in COLUMNS:  # a fresh app per cell: /drain, once served, changes the rest
        async with TestClient(TestServer(worker_app(), host="127.0.0.1")) as client:
            resp = await client.request(method, path or template, headers=headers(column), **kwargs)
            await _check_body(resp)
            got.append(resp.status)
    assert tuple(got) == expected, dict(zip(COLUMNS, got, strict=True))


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[Router, list[FakeWorker]]]:
    board = KVBoard()
    workers = [FakeWorker("prefill", board, bootstrap_port=18999), FakeWorker("decode", board)]
    for w in workers:
        await w.start()
    config = replace(
        TEST_CONFIG,
        prefill_urls=(workers[0].url,),
        decode_urls=(workers[1].url,),
        api_key=CLIENT_KEY,
        admin_api_key=ADMIN_KEY,
        registration_token=REGISTRATION_TOKEN,
        worker_api_key="worker-key",
    )
    router = Router(config, rng=random.Random(0))
    await router.start()
    await router.health.check_all()
    try:
        yield router, workers
    finally:
        await router.stop()
        for w in workers:
            await w.stop()


async def test_router_routes_answer_each_credential_as_the_table_says(fleet) -> None:
    router, workers = fleet
    assert router._runner is not None
    assert routes_of(router._runner.app) == set(ROUTER_TABLE)
    wrong: dict[str, dict[str, int]] = {}
    async with aiohttp.ClientSession() as session:
        for (method, template), (path, kwargs, expected) in sorted(ROUTER_TABLE.items()):
            got = []
            for column in COLUMNS:
                async with session.request(
                    method, router.url + (path or template), headers=headers(column), **kwargs
                ) as resp:
                    await _check_body(resp)
                    got.append(resp.status)
            if tuple(got) != expected:
                wrong[f"{method} {template}"] = dict(zip(COLUMNS, got, strict=True))
    assert not wrong
    # The router reached its workers with their key only, never with a client's.
    assert {r.authorization for w in workers for r in w.requests} == {"Bearer worker-key"}


async def _check_body(resp: Any) -> None:
    """A refusal is an OpenAI error naming why (401s ask for a Bearer key)."""
    if resp.status not in (401, 403) or resp.method == "HEAD":
        return
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] in ("invalid_api_key", "permission_denied"), error
    if resp.status == 401:
        assert resp.headers["WWW-Authenticate"] == "Bearer"
