"""The router's aiohttp app and the :class:`Router` that owns it, its ClientSession, the
health checker and the dispatcher."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import secrets
from collections.abc import Coroutine
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.auth import (
    ABORT,
    ADMIN,
    CALLER,
    CLIENT,
    METRICS,
    OPEN,
    REGISTRATION,
    AccessPolicy,
    Denial,
    may_abort,
)
from pdserve.router.config import RouterConfig
from pdserve.router.errors import error_response
from pdserve.router.health import HealthChecker
from pdserve.router.legs import UpstreamClient
from pdserve.router.metrics import build_registry
from pdserve.router.proxy import Dispatcher
from pdserve.router.registry_api import RegistryApi
from pdserve.router.stats import RouterStats
from pdserve.router.vetting import WorkerVetting
from pdserve.router.worker_allow import WorkerAllowList
from pdserve.router.workers import WorkerManager

logger = logging.getLogger(__name__)

_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Who may call each route (pdserve/auth.py); a route missing here fails the router's start.
ROUTE_ACCESS = {
    "/v1/chat/completions": CLIENT,
    "/v1/completions": CLIENT,
    "/v1/responses": CLIENT,
    "/v1/models": CLIENT,
    "/tokenize": CLIENT,
    "/detokenize": CLIENT,
    "/health": OPEN,
    "/health/ready": OPEN,
    "/health/pd": OPEN,
    "/metrics": METRICS,
    "/abort/{request_id}": ABORT,
    "/workers": ADMIN,
    "/workers/register": REGISTRATION,
    "/workers/deregister": REGISTRATION,
    "/debug/requests": ADMIN,
}
_ID_PREFIX = {
    "/v1/chat/completions": "chatcmpl-",
    "/v1/completions": "cmpl-",
    "/v1/responses": "resp-",
}


class Router:
    """PD-aware OpenAI-compatible router. ``async with Router(cfg) as router: ...``."""

    def __init__(self, config: RouterConfig, *, rng: random.Random | None = None) -> None:
        self.config = config
        self.rng = rng or random.Random()
        self.workers = WorkerManager(config)
        for role, urls in (
            ("prefill", config.prefill_urls),
            ("decode", config.decode_urls),
            ("colocated", config.worker_urls),
        ):
            for url in urls:
                self.workers.add(url, role)
        self.stats = RouterStats()
        self.registry = build_registry(self.stats, self.workers)
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._health: HealthChecker | None = None
        self._dispatcher: Dispatcher | None = None
        self._stop = asyncio.Event()
        self._health_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._port: int | None = None
        self.is_draining = False
        self._access = AccessPolicy(config.credentials, ROUTE_ACCESS, "router")
        self.allow = WorkerAllowList.parse(config.worker_allow)

    @property
    def port(self) -> int:
        """The bound port (useful with ``port=0``)."""
        if self._port is None:
            raise RuntimeError("router not started")
        return self._port

    @property
    def url(self) -> str:
        """Base URL clients use, e.g. ``http://127.0.0.1:30000`` (``https://`` with TLS)."""
        return f"{self.config.tls.scheme}://{self.config.host}:{self.port}"

    @property
    def health(self) -> HealthChecker:
        """The health checker; ``await router.health.check_all()`` forces a probe round."""
        if self._health is None:
            raise RuntimeError("router not started")
        return self._health

    async def start(self) -> None:
        """Bind the HTTP server and start health checks (workers may come up later)."""
        try:
            await self._start()
        except BaseException:
            await self.stop()  # e.g. the port is taken: do not leak the session
            raise

    async def _start(self) -> None:
        cfg = self.config
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(
                total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s
            ),
            connector=aiohttp.TCPConnector(limit=0, ssl=cfg.tls.client_context()),
        )
        self._health = HealthChecker(cfg, self.workers, self._session)
        upstream = UpstreamClient(cfg, self._session)
        self._dispatcher = Dispatcher(
            cfg, self.workers, upstream, self.stats, self.rng, self._spawn
        )
        self._runner = web.AppRunner(
            self._build_app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=cfg.abort_timeout_s,
        )
        await self._runner.setup()
        self._access.log_warnings()
        site = web.TCPSite(self._runner, cfg.host, cfg.port, ssl_context=cfg.tls.server_context())
        await site.start()
        self._port = self._runner.addresses[0][1]
        self._health_task = asyncio.create_task(self._health.run(self._stop))
        logger.info("router listening on %s (policy %s)", self.url, cfg.policy)

    async def stop(self) -> None:
        """Stop serving; in-flight requests are cancelled and their legs aborted."""
        self._stop.set()
        if self._health_task is not None:
            await asyncio.wait({self._health_task}, timeout=self.config.health_timeout_s)
            self._health_task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._background:  # abort calls spawned by cancelled handlers get a short grace
            await asyncio.wait(set(self._background), timeout=self.config.abort_timeout_s)
            for task in self._background:
                task.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None
        logger.info("router stopped")

    async def drain(self) -> bool:
        """Stop taking requests (readiness 503, new ones a retryable 503 with Retry-After) and
        wait up to ``drain_timeout_s`` for those in flight; True if all ended. Then stop()."""
        if not self.is_draining:
            self.is_draining = True
            logger.info("router: serving -> draining")
        dispatcher = self._dispatcher
        if dispatcher is None:
            return True
        try:
            async with asyncio.timeout(self.config.drain_timeout_s):
                await dispatcher.wait_idle()
        except TimeoutError:
            logger.warning("router: drain timed out, %d requests in flight", dispatcher.num_active)
            return False
        logger.info("router: drained")
        return True

    def _draining_response(self) -> web.Response:
        headers = {"Retry-After": str(self.config.retry_after_s)}
        message = "router is draining and takes no new requests; retry"
        return error_response(503, message, err_type="draining", code="draining", headers=headers)

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _build_app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._error_middleware, self._auth_middleware],
            client_max_size=self.config.max_body_bytes,
        )
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/responses", self._completions)  # PD legs like a chat
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenizer_call)
        app.router.add_post("/detokenize", self._tokenizer_call)
        app.router.add_get("/health", self._alive)
        app.router.add_get("/health/ready", self._ready)
        app.router.add_get("/health/pd", self._pd_ready)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/abort/{request_id}", self._abort)
        vetting = WorkerVetting(self.config, self.workers, self.health, self.allow)
        RegistryApi(self.workers, self.health, vetting).add_routes(app)
        app.router.add_get("/debug/requests", self._debug_requests)
        self._access.check_routes(app)
        return app

    @web.middleware
    async def _error_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(exc.status, exc.text or exc.reason)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            logger.exception("router: unexpected error on %s %s", request.method, request.path)
            return error_response(500, "internal router error", err_type="server_error")

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        access = self._access
        decision = access.decide(
            access.kind_of(request), request.headers.get("Authorization"), request.remote
        )
        if isinstance(decision, Denial):
            return error_response(
                decision.status, decision.message, code=decision.code, headers=decision.headers
            )
        request[CALLER] = decision
        return await handler(request)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        if self.is_draining:
            return self._draining_response()
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return error_response(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        rid = request.headers.get("X-Request-Id")
        if rid is None:
            rid = _ID_PREFIX[request.path] + secrets.token_hex(16)  # unguessable
        elif not _REQUEST_ID_RE.fullmatch(rid):
            return error_response(400, "X-Request-Id must be 1-128 chars of [A-Za-z0-9._:-]")
        assert self._dispatcher is not None
        if self._dispatcher.is_active(rid):
            return error_response(409, f"request id {rid} is already in flight")
        owner = request[CALLER].owner
        return await self._dispatcher.handle(request, request.path, body, raw, rid, owner)

    async def _models(self, request: web.Request) -> web.Response:
        reply = await self._ask_any_worker("GET", "/v1/models", None, ok_only=True)
        return reply or error_response(503, "no healthy worker to list models")

    async def _tokenizer_call(self, request: web.Request) -> web.Response:
        """/tokenize and /detokenize: every worker holds the same tokenizer; ask one (its
        4xx answers are the client's and are passed on as they are)."""
        body = await request.read()
        reply = await self._ask_any_worker("POST", request.path, body, ok_only=False)
        return reply or error_response(503, f"no healthy worker to serve {request.path}")

    async def _ask_any_worker(
        self, method: str, path: str, body: bytes | None, ok_only: bool
    ) -> web.Response | None:
        """The first answer (200, or any non-5xx unless ``ok_only``) of a healthy worker."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        headers = {"Content-Type": "application/json"}
        if self.config.worker_api_key:
            headers["Authorization"] = f"Bearer {self.config.worker_api_key}"
        for role in ("decode", "colocated", "prefill"):
            for worker in self.workers.available(role):
                try:
                    async with self._session.request(
                        method, f"{worker.url}{path}", data=body, timeout=timeout, headers=headers
                    ) as resp:
                        if resp.status == 200 or (not ok_only and resp.status < 500):
                            return web.Response(
                                status=resp.status,
                                body=await resp.read(),
                                content_type="application/json",
                            )
                        logger.info("%s %s from %s: %d", method, path, worker.url, resp.status)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    logger.info("%s %s from %s failed: %s", method, path, worker.url, exc)
        return None

    async def _alive(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _ready(self, request: web.Request) -> web.Response:
        """Readiness for a balancer: by ``--readiness``, any serving path (the default: a
        router whose fleet lost every prefill still serves through the decode fallback) or
        the full PD path."""
        return self._readiness(self.config.readiness)

    async def _pd_ready(self, request: web.Request) -> web.Response:
        """200 while the full path is up (a prefill+decode pair or a colocated worker): what a
        harness waits for before it measures the PD path, whatever ``--readiness`` says."""
        return self._readiness("pd")

    def _readiness(self, mode: str) -> web.Response:
        pd_path = self.workers.has_complete_path()
        serving_path = self.workers.has_serving_path()
        is_ready = (pd_path if mode == "pd" else serving_path) and not self.is_draining
        counts = {
            role: len(self.workers.available(role)) for role in ("prefill", "decode", "colocated")
        }
        body = {
            "ready": is_ready,
            "mode": mode,
            "pd_path": pd_path,
            "serving_path": serving_path,
            "draining": self.is_draining,
            "available": counts,
        }
        return web.json_response(body, status=200 if is_ready else 503, dumps=_dumps)

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _abort(self, request: web.Request) -> web.Response:
        """An admin aborts any request; a client only one its own key started (else 404, the
        same answer as for an id not in flight: others' ids cannot be probed)."""
        assert self._dispatcher is not None
        rid = request.match_info["request_id"]
        caller = request[CALLER]
        if not may_abort(caller, self._dispatcher.owner_of(rid)):
            message = f"no request {rid} of yours is in flight"
            return error_response(404, message, param="request_id", code="not_found")
        return web.json_response({"aborted": self._dispatcher.abort(rid)}, dumps=_dumps)

    async def _debug_requests(self, request: web.Request) -> web.Response:
        assert self._dispatcher is not None
        return web.json_response({"data": self._dispatcher.debug_requests()}, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()
