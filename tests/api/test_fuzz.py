"""Fuzzing request bodies against a live server: never a 5xx, healthy afterwards.

The server runs on its own event loop in a thread so hypothesis can drive it synchronously.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from pdserve.api import build_app, fields, start_http

from .conftest import chat_body, completion_body, make_config
from .engine_double import FakeEngine
from .sse_utils import parse_sse

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CHAT_FIELDS = sorted(fields.CHAT_SUPPORTED | fields.CHAT_IGNORED | set(fields.CHAT_CONDITIONAL))
COMPLETION_FIELDS = sorted(
    fields.COMPLETION_SUPPORTED | fields.COMPLETION_IGNORED | set(fields.COMPLETION_CONDITIONAL)
)


class ThreadedServer:
    """The app served by start_http on a private loop in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        self.runner, self.port = self._call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    async def _start(self) -> Any:
        # Created on the server's loop: the engine's asyncio primitives belong to it.
        engine = FakeEngine(max_model_len=64)
        config = make_config(max_body_bytes=16 * 1024)
        return await start_http(build_app(engine, config, CollectorRegistry()), "127.0.0.1", 0)

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict | None = None
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    with ThreadedServer() as threaded:
        yield threaded


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=24),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)
# Values near the valid ranges reach the deeper checks more often than arbitrary JSON.
plausible_values = st.one_of(
    st.integers(min_value=-3, max_value=80),
    st.floats(min_value=-3, max_value=3),
    st.text(max_size=8),
    st.lists(st.text(max_size=4) | st.integers(min_value=-1, max_value=300), max_size=20),
    st.fixed_dictionaries({"include_usage": st.booleans()}),
)
values = json_values | plausible_values


def _mutated(path: str, base: dict, names: list[str]) -> st.SearchStrategy:
    """A valid body for ``path`` with a few of its known fields set to random values."""
    changes = st.dictionaries(st.sampled_from(names), values, min_size=1, max_size=3)
    return st.tuples(st.just(path), changes.map(lambda c: {**base, **c}))


def _encode(item: tuple[str, object]) -> tuple[str, bytes]:
    # stdlib json, not orjson: ints beyond 64 bits must be able to travel too.
    return item[0], json.dumps(item[1]).encode()


paths = st.sampled_from((CHAT, COMPLETIONS))
requests = st.one_of(
    _mutated(CHAT, chat_body("fuzz", max_tokens=4), CHAT_FIELDS).map(_encode),
    _mutated(COMPLETIONS, completion_body("fuzz", max_tokens=4), COMPLETION_FIELDS).map(_encode),
    st.tuples(
        paths,
        st.dictionaries(
            st.sampled_from(CHAT_FIELDS) | st.text(min_size=1, max_size=12), values, max_size=8
        ),
    ).map(_encode),
    st.tuples(paths, json_values).map(_encode),
    st.tuples(paths, st.binary(max_size=256)),
)
request_ids = st.one_of(
    st.none(),
    st.none(),
    st.from_regex(r"[A-Za-z0-9._:-]{1,40}", fullmatch=True),
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=140),
)


def _check_response(status: int, payload: bytes) -> None:
    assert status < 500, payload[:300]
    if status >= 400:
        error = orjson.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"}
    elif payload.startswith(b"data: "):
        _, is_done = parse_sse(payload)
        assert is_done
    else:
        assert "choices" in orjson.loads(payload)


@settings(
    max_examples=150,
    deadline=2000,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(request=requests, request_id=request_ids)
def test_fuzzed_bodies_never_get_a_5xx(
    server: ThreadedServer, request: tuple[str, bytes], request_id: str | None
) -> None:
    path, body = request
    headers = {"Content-Type": "application/json"}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    status, payload = server.request("POST", path, body, headers)
    _check_response(status, payload)


def test_server_is_healthy_and_idle_after_fuzzing(server: ThreadedServer) -> None:
    # Runs after the fuzz test (file order): nothing left running, still serving.
    assert server.request("GET", "/health")[0] == 200
    status, payload = server.request("POST", CHAT, orjson.dumps(chat_body("ok", max_tokens=2)))
    assert status == 200 and orjson.loads(payload)["choices"][0]["message"]["content"] == "<u"
    status, payload = server.request("GET", "/debug/requests")
    assert status == 200 and orjson.loads(payload) == {"data": []}
