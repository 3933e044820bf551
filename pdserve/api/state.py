"""What handlers find in the app: one typed ApiContext under the API_CONTEXT key."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from pdserve.api.config import ApiConfig
from pdserve.api.drain import DrainGate
from pdserve.api.grammar_service import GrammarService
from pdserve.api.logprobs import TokenTexts
from pdserve.api.metrics import HttpMetrics
from pdserve.api.reasoning import ReasoningTokens
from pdserve.auth import RequestOwners
from pdserve.engine.protocol import EngineClient


@dataclass(frozen=True)
class ApiContext:
    engine: EngineClient
    config: ApiConfig
    metrics: HttpMetrics
    token_texts: TokenTexts
    created: int  # advertised as the model's creation time in /v1/models
    grammars: GrammarService  # structured outputs: compiles constraints per request
    drain: DrainGate = field(default_factory=DrainGate)  # POST /drain and SIGTERM flip it
    # request id -> owner tag (pdserve/auth.py) of each request being served: a client's
    # abort names one of its own (api/admin.py), live or recently ended.
    owners: RequestOwners = field(default_factory=RequestOwners)
    reasoning: ReasoningTokens | None = None  # --reasoning-parser, resolved in the tokenizer
    tool_parser: str = "hermes"  # --tool-call-parser, "auto" resolved from the chat template


API_CONTEXT: web.AppKey[ApiContext] = web.AppKey("pdserve_api_context", ApiContext)


def api_context(request: web.Request) -> ApiContext:
    return request.app[API_CONTEXT]


# Set by a streaming handler whose client vanished mid-stream (its status is already 200).
CLIENT_GONE: web.RequestKey[bool] = web.RequestKey("pdserve_client_gone", bool)
