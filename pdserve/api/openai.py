"""OpenAI endpoint handlers: thin glue from HTTP to parsing, preparation and serving."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from pdserve.api.body import read_json_object
from pdserve.api.errors import model_not_found, unsupported
from pdserve.api.options import RequestOptions
from pdserve.api.prepare import PreparedRequest, prepare_chat, prepare_completion
from pdserve.api.protocol import (
    ChatCompletionRequest,
    parse_chat_request,
    parse_completion_request,
    resolve_request_id,
)
from pdserve.api.reasoning import ChoiceReasoning, attach_reasoning
from pdserve.api.responses import ChatResponseBuilder, CompletionResponseBuilder
from pdserve.api.responses_api import ResponsesBuilder, chat_body
from pdserve.api.serve import serve_prepared
from pdserve.api.state import ApiContext, api_context
from pdserve.api.tool_parsers import needs_special_tokens


async def _read(request: web.Request, ctx: ApiContext) -> dict[str, Any]:
    config = ctx.config
    return await read_json_object(request, config.max_body_bytes, config.body_read_timeout_s)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions"""
    ctx = api_context(request)
    body = await _read(request, ctx)
    rid = resolve_request_id(
        request.headers.get("X-Request-Id"), "chatcmpl", body.get("request_id")
    )
    engine = ctx.engine
    parsed = parse_chat_request(body, ctx.config, engine.tokenizer.vocab_size)
    _check_prompt_logits(ctx, parsed.options)
    tools = parsed.tools
    if tools is not None and tools.mode == "auto" and needs_special_tokens(ctx.tool_parser):
        parsed.options.skip_special_tokens = False  # its call markers are special tokens
    prepared = await prepare_chat(
        parsed, rid, engine.tokenizer, engine.info.max_model_len, ctx.config
    )
    await _attach_grammars(ctx, prepared)
    reasoning = _attach_reasoning(ctx, prepared, parsed)
    builder = ChatResponseBuilder(
        prepared, ctx.token_texts, parsed.tools, reasoning, tool_parser=ctx.tool_parser
    )
    return await serve_prepared(request, ctx, prepared, builder)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions"""
    ctx = api_context(request)
    body = await _read(request, ctx)
    rid = resolve_request_id(request.headers.get("X-Request-Id"), "cmpl", body.get("request_id"))
    engine = ctx.engine
    parsed = parse_completion_request(body, ctx.config, engine.tokenizer.vocab_size)
    _check_prompt_logits(ctx, parsed.options)
    prepared = await prepare_completion(
        parsed, rid, engine.tokenizer, engine.info.max_model_len, ctx.config
    )
    await _attach_grammars(ctx, prepared)
    builder = CompletionResponseBuilder(prepared, ctx.token_texts)
    return await serve_prepared(request, ctx, prepared, builder)


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses: served as the chat completion it stands for (responses_api.py)."""
    ctx = api_context(request)
    body = await _read(request, ctx)
    rid = resolve_request_id(request.headers.get("X-Request-Id"), "resp")
    engine = ctx.engine
    parsed = parse_chat_request(chat_body(body), ctx.config, engine.tokenizer.vocab_size)
    prepared = await prepare_chat(
        parsed, rid, engine.tokenizer, engine.info.max_model_len, ctx.config
    )
    # The thinking block is split off (the output text is the answer; no reasoning items yet).
    chat = ChatResponseBuilder(
        prepared, ctx.token_texts, None, _attach_reasoning(ctx, prepared, parsed)
    )
    builder = ResponsesBuilder(chat, body)
    return await serve_prepared(request, ctx, prepared, builder)


def _check_prompt_logits(ctx: ApiContext, options: RequestOptions) -> None:
    """Prompt logprobs exist where the prompt is prefilled: on a colocated worker, or on a
    decode worker that prefills the request itself (no ``kv_transfer_params``: the router
    sends prompt-scoring requests there). A PD leg pair cannot answer them."""
    if options.num_prompt_top_logprobs is None:
        return
    role = ctx.engine.info.role
    if role == "colocated" or (role == "decode" and options.kv_transfer is None):
        return
    param = "prompt_logprobs" if options.prompt_logprobs is not None else "echo"
    raise unsupported(param, "prompt logprobs are not computed on a prefill/decode leg pair")


async def _attach_grammars(ctx: ApiContext, prepared: PreparedRequest) -> None:
    # Each choice advances its own matcher; the compile is shared (and cached).
    constraint = prepared.options.constraint
    if constraint is None:
        return
    matchers = await ctx.grammars.matchers(constraint, prepared.num_choices)
    for req, matcher in zip(prepared.engine_requests, matchers, strict=True):
        req.grammar = matcher


def _attach_reasoning(
    ctx: ApiContext, prepared: PreparedRequest, parsed: ChatCompletionRequest
) -> ChoiceReasoning | None:
    # --reasoning-parser: each choice's thinking block for the engine, its split for the reply.
    return attach_reasoning(
        prepared.engine_requests, ctx.reasoning, parsed.reasoning, parsed.template.kwargs,
        ctx.engine.tokenizer,
    )  # fmt: skip


def _model_card(ctx: ApiContext) -> dict[str, Any]:
    return {
        "id": ctx.config.served_model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "pdserve",
        "max_model_len": ctx.engine.info.max_model_len,
    }


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models"""
    ctx = api_context(request)
    return _json({"object": "list", "data": [_model_card(ctx)]})


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}"""
    ctx = api_context(request)
    model = request.match_info["model"]
    if model != ctx.config.served_model_name:
        raise model_not_found(model)
    return _json(_model_card(ctx))


def _json(payload: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")
