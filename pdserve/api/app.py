"""The worker's aiohttp application (:func:`build_app`) and its listener (:func:`start_http`)."""

from __future__ import annotations

import ssl
import time

from aiohttp import web
from prometheus_client import CollectorRegistry

from pdserve.api import admin, openai, tokenize
from pdserve.api.config import ApiConfig
from pdserve.api.drain import DrainGate, drain_middleware
from pdserve.api.grammar_service import GrammarService
from pdserve.api.logprobs import TokenTexts
from pdserve.api.metrics import HttpMetrics
from pdserve.api.middleware import auth_middleware, error_middleware, metrics_middleware
from pdserve.api.reasoning import resolve_reasoning
from pdserve.api.state import API_CONTEXT, ApiContext
from pdserve.api.tool_parsers import resolve_parser
from pdserve.auth import ABORT, ADMIN, CLIENT, METRICS, OPEN, AccessPolicy, Credentials, as_keys
from pdserve.engine.protocol import EngineClient

# Who may call each route (pdserve/auth.py); a route missing here fails build_app.
ROUTE_ACCESS = {
    "/v1/chat/completions": CLIENT,
    "/v1/completions": CLIENT,
    "/v1/responses": CLIENT,
    "/tokenize": CLIENT,
    "/detokenize": CLIENT,
    "/v1/models": CLIENT,
    "/v1/models/{model}": CLIENT,
    "/health": OPEN,
    "/health/ready": OPEN,
    "/server_info": OPEN,  # a worker's identity: routers verify it before routing to it
    "/metrics": METRICS,
    "/debug/requests": ADMIN,
    "/debug/rooms": ADMIN,
    "/abort/{request_id}": ABORT,
    "/drain": ADMIN,
}


def build_app(
    engine: EngineClient,
    config: ApiConfig,
    registry: CollectorRegistry,
    drain: DrainGate | None = None,
) -> web.Application:
    """OpenAI-compatible API plus health, metrics, server_info, debug and abort endpoints.

    Registers the HTTP metrics in ``registry`` (so one registry serves one app) and serves the
    whole registry at ``/metrics``. ``drain`` is the gate ``POST /drain`` flips (the server
    passes its own, which SIGTERM flips too).
    """
    drain = drain if drain is not None else DrainGate()
    metrics = HttpMetrics.create(registry)
    creds = Credentials(as_keys(config.api_key), config.admin_api_key, None, config.metrics_open)
    policy = AccessPolicy(creds, ROUTE_ACCESS, "worker")
    middlewares = [metrics_middleware(metrics), error_middleware(metrics), auth_middleware(policy)]
    middlewares.append(drain_middleware(drain))  # inside auth: a drain is no key oracle
    app = web.Application(middlewares=middlewares)
    app[API_CONTEXT] = ApiContext(
        engine=engine,
        config=config,
        metrics=metrics,
        token_texts=TokenTexts(engine.tokenizer),
        created=int(time.time()),
        grammars=GrammarService(engine.tokenizer),
        drain=drain,
        reasoning=resolve_reasoning(config.reasoning_parser, engine.tokenizer),
        tool_parser=resolve_parser(
            config.tool_call_parser, getattr(engine.tokenizer, "chat_template", None)
        ),
    )
    app.router.add_post("/v1/chat/completions", openai.chat_completions)
    app.router.add_post("/v1/completions", openai.completions)
    app.router.add_post("/v1/responses", openai.responses)
    app.router.add_post("/tokenize", tokenize.tokenize)
    app.router.add_post("/detokenize", tokenize.detokenize)
    app.router.add_get("/v1/models", openai.list_models, allow_head=False)
    app.router.add_get("/v1/models/{model}", openai.retrieve_model, allow_head=False)
    app.router.add_get("/health", admin.health)
    app.router.add_get("/health/ready", admin.ready)
    app.router.add_get("/metrics", admin.metrics_handler(registry), allow_head=False)
    app.router.add_get("/server_info", admin.server_info, allow_head=False)
    app.router.add_get("/debug/requests", admin.debug_requests, allow_head=False)
    app.router.add_get("/debug/rooms", admin.debug_rooms, allow_head=False)
    app.router.add_post("/abort/{request_id}", admin.abort)
    app.router.add_post("/drain", admin.drain)
    policy.check_routes(app)
    policy.log_warnings()
    return app


async def start_http(
    app: web.Application,
    host: str,
    port: int,
    access_log: bool = False,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (0 = ephemeral), HTTPS with ``ssl_context``; returns the
    runner and the bound port.

    ``handler_cancellation=True``: a client that disconnects cancels its handler, whose cleanup
    aborts the request in the engine. Stop with ``await runner.cleanup()``.
    """
    # access_log=None switches aiohttp's per-request access logging off.
    log_kwargs = {} if access_log else {"access_log": None}
    runner = web.AppRunner(app, handler_cancellation=True, **log_kwargs)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = runner.addresses[0][1]
    return runner, bound_port
