"""Worker doubles for router tests: small aiohttp apps on 127.0.0.1 that follow the worker
HTTP contract (OpenAI endpoints, /health, /health/ready, /server_info, /abort/{rid}).

The prefill and decode doubles share a ``KVBoard`` standing in for the NIXL hand-off: the
prefill double marks a room's KV as sent, the decode double waits for it (with a timeout)
before its first token, as a real decode worker waits for the prefill's KV.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
import pytest
from aiohttp import web

from pdserve.keepalive import KEEPALIVE_HEADER
from pdserve.router import Router, RouterConfig


@dataclass
class KVBoard:
    rooms: dict[str, asyncio.Event] = field(default_factory=dict)

    def _event(self, room_id: str) -> asyncio.Event:
        return self.rooms.setdefault(room_id, asyncio.Event())

    def mark_sent(self, room_id: str) -> None:
        self._event(room_id).set()

    async def wait(self, room_id: str, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._event(room_id).wait(), timeout_s)
        except TimeoutError:
            return False
        return True


@dataclass
class Recorded:
    request_id: str
    path: str
    body: dict[str, Any]
    authorization: str | None
    keepalive: str | None = None  # its X-PDServe-SSE-Keepalive header


class FakeWorker:
    """A prefill, decode or colocated worker double; knobs are plain attributes."""

    def __init__(self, role: str, board: KVBoard, *, bootstrap_port: int | None = None) -> None:
        self.role = role
        self.board = board
        self.model = "fake-model"
        self.dtype = "bfloat16"
        self.kv_layout = "layout-1"  # what /server_info publishes (router/compat.py)
        self.weights = ""  # published as server_info.weights when set
        self.incarnation = "inc-1"
        self.bootstrap_port = bootstrap_port if role == "prefill" else None
        self.is_ready = True
        self.num_chunks = 4
        self.num_thinking_chunks = 0  # chat: the first N chunks carry reasoning_content
        self.fail_status: int | None = None  # answer completions with this error status
        self.fail_code: str | None = None  # ... and this OpenAI error code
        self.is_hanging = False  # completions never answer until cancelled or aborted
        self.hold: asyncio.Event | None = None  # completions answer once it is set (slow prefill)
        self.kv_wait_timeout_s = 5.0
        self.gate: asyncio.Semaphore | None = None  # each chunk after the first waits on it
        self.die_after_chunks: int | None = None  # drop the connection after N chunks
        self.is_sse_error_first = False
        self.is_holding_after_done = False  # keep the body open after [DONE] until aborted
        self.requests: list[Recorded] = []
        self.aborts: list[str] = []
        self.cancelled: list[str] = []  # handlers cancelled: the router went away
        self.num_health_checks = 0
        self.num_info_checks = 0  # GET /server_info: the router's identity probes
        self.load: dict[str, Any] | None = None  # reported as server_info.load when set
        self.tokenized: list[dict[str, Any]] = []  # /tokenize bodies (a token per word)
        self.is_tokenize_broken = False  # /tokenize answers 500
        self._abort_events: dict[str, asyncio.Event] = {}
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/responses", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health/ready", self._ready)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_post("/abort/{rid}", self._abort)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def restart(self, incarnation: str, bootstrap_port: int | None = None) -> None:
        """Stop and start again on the same port, as a new process would."""
        port = self.port
        await self.stop()
        self.incarnation = incarnation
        if bootstrap_port is not None:
            self.bootstrap_port = bootstrap_port
        await self.start(port)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _ready(self, request: web.Request) -> web.Response:
        self.num_health_checks += 1
        return web.json_response({"ready": self.is_ready}, status=200 if self.is_ready else 503)

    async def _server_info(self, request: web.Request) -> web.Response:
        self.num_info_checks += 1
        info = {
            "role": self.role,
            "model": self.model,
            "engine_id": f"{self.role}-{self.port}",
            "incarnation": self.incarnation,
            "bootstrap_port": self.bootstrap_port,
            "max_model_len": 4096,
            "dtype": self.dtype,
            "kv_layout": self.kv_layout,
        }
        if self.load is not None:
            info["load"] = self.load
        if self.weights:
            info["weights"] = self.weights
        return web.json_response(info)

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.tokenized.append(body)
        if self.is_tokenize_broken:
            return _error(500, "tokenizer broke")
        text = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", []))
        return web.json_response({"count": len(text.split()), "max_model_len": 4096})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        return web.json_response({"prompt": " ".join(f"t{i}" for i in body.get("tokens", []))})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        )

    async def _abort(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        self.aborts.append(rid)
        event = self._abort_events.get(rid)
        if event is not None:
            event.set()
        return web.json_response({"aborted": event is not None})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        rid = request.headers.get("X-Request-Id", "no-rid")
        self.requests.append(
            Recorded(rid, request.path, body, request.headers.get("Authorization"),
                     request.headers.get(KEEPALIVE_HEADER))
        )  # fmt: skip
        aborted = self._abort_events.setdefault(rid, asyncio.Event())
        try:
            return await self._answer(request, rid, body, aborted)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self._abort_events.pop(rid, None)

    async def _answer(
        self, request: web.Request, rid: str, body: dict[str, Any], aborted: asyncio.Event
    ) -> web.StreamResponse:
        if self.is_hanging:
            await aborted.wait()
            return _error(503, "aborted while hanging")
        if self.hold is not None:
            await self.hold.wait()
        if self.fail_status is not None:
            return _error(self.fail_status, f"told to fail with {self.fail_status}", self.fail_code)
        kv = body.get("kv_transfer_params")
        if self.role == "prefill":
            self.board.mark_sent(kv["room_id"])
            return web.json_response(_completion(request.path, rid, self.model, ["x"]))
        if kv is not None and not await self.board.wait(kv["room_id"], self.kv_wait_timeout_s):
            return _error(503, "timeout:waiting_for_kv")
        if not body.get("stream"):
            tokens = [f"t{i} " for i in range(self.num_chunks)]
            return web.json_response(_completion(request.path, rid, self.model, tokens))
        return await self._stream(request, rid, body, aborted)

    async def _stream(
        self, request: web.Request, rid: str, body: dict[str, Any], aborted: asyncio.Event
    ) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if self.is_sse_error_first:
            err = {"error": {"message": "engine failed", "type": "service_unavailable"}}
            await out.write(_sse(err) + b"data: [DONE]\n\n")
            return out
        finish = "length"
        # Migration: chunk i carries token id i; a resumed stream starts after the given ids.
        with_ids = body.get("return_token_ids") is True
        start = len((body.get("resume_params") or {}).get("token_ids", []))
        for i in range(start, self.num_chunks):
            if i and self.gate is not None and not await _first_of(self.gate.acquire(), aborted):
                finish = "abort"
                break
            chunk = _chunk(request.path, rid, self.model, f"t{i} ", None)
            if i < self.num_thinking_chunks:  # a worker's --reasoning-parser at work
                chunk["choices"][0]["delta"] = {"reasoning_content": f"t{i} "}
            if with_ids:
                chunk["choices"][0]["token_ids"] = [i]
            await out.write(_sse(chunk))
            if self.die_after_chunks == i + 1 - start:
                assert request.transport is not None
                request.transport.abort()  # an abrupt crash, not a clean end
                return out
        await out.write(_sse(_chunk(request.path, rid, self.model, "", finish)))
        await out.write(b"data: [DONE]\n\n")
        if self.is_holding_after_done:
            await aborted.wait()
        return out


async def _first_of(acquire: Awaitable[Any], aborted: asyncio.Event) -> bool:
    """True if ``acquire`` finished first, False if the request was aborted first."""
    gate_task = asyncio.ensure_future(acquire)
    abort_task = asyncio.ensure_future(aborted.wait())
    try:
        done, _ = await asyncio.wait({gate_task, abort_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gate_task.cancel()
        abort_task.cancel()
    return gate_task in done and not gate_task.cancelled()


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _error(status: int, message: str, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": "fake_error", "param": None, "code": code}}
    return web.json_response(body, status=status)


def _chunk(path: str, rid: str, model: str, text: str, finish: str | None) -> dict[str, Any]:
    base = {"id": rid, "created": int(time.time()), "model": model}
    if path.endswith("chat/completions"):
        delta = {"content": text} if text else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {**base, "object": "chat.completion.chunk", "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": finish}
    return {**base, "object": "text_completion", "choices": [choice]}


def _completion(path: str, rid: str, model: str, tokens: list[str]) -> dict[str, Any]:
    text = "".join(tokens)
    usage = {"prompt_tokens": 3, "completion_tokens": len(tokens), "total_tokens": 3 + len(tokens)}
    base = {"id": rid, "created": int(time.time()), "model": model, "usage": usage}
    if path.endswith("chat/completions"):
        msg = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": msg, "finish_reason": "length"}
        return {**base, "object": "chat.completion", "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": "length"}
    return {**base, "object": "text_completion", "choices": [choice]}


WaitUntil = Callable[..., Awaitable[None]]


async def _wait_until(
    predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = ""
) -> None:
    """Poll a condition with a deadline (the tests' only way to wait for async effects)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}")
        await asyncio.sleep(0.01)


@pytest.fixture
def wait_until() -> WaitUntil:
    return _wait_until


@pytest.fixture
def board() -> KVBoard:
    return KVBoard()


@pytest.fixture
async def make_worker(board: KVBoard) -> AsyncIterator[Callable[..., Awaitable[FakeWorker]]]:
    workers: list[FakeWorker] = []
    next_bootstrap = iter(range(18000, 19000))

    async def make(role: str) -> FakeWorker:
        worker = FakeWorker(role, board, bootstrap_port=next(next_bootstrap))
        await worker.start()
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        await worker.stop()


TEST_CONFIG = RouterConfig(
    port=0,
    policy="round_robin",  # the tests' expectations of who gets what; auto has its own
    health_interval_s=30.0,  # tests drive probes with router.health.check_all()
    health_timeout_s=1.0,
    connect_timeout_s=1.0,
    request_timeout_s=10.0,
    abort_timeout_s=1.0,
    backoff_base_s=0.001,
    max_backoff_s=0.01,
)


@pytest.fixture
async def make_router() -> AsyncIterator[Callable[..., Awaitable[Router]]]:
    routers: list[Router] = []

    async def make(*, is_ready_required: bool = True, **overrides: Any) -> Router:
        router = Router(replace(TEST_CONFIG, **overrides), rng=random.Random(1234))
        await router.start()
        routers.append(router)
        await router.health.check_all()
        if is_ready_required:
            assert router.workers.has_complete_path(), [w.to_json() for w in router.workers.all()]
        return router

    yield make
    for router in routers:
        # Whatever a test did, the router's own accounting must come back to idle.
        await _wait_until(
            lambda r=router: all(w.num_in_flight == 0 for w in r.workers.all()),
            what="in-flight counts back to zero",
        )
        await router.stop()
