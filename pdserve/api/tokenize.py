"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's request and response shapes.

/tokenize takes ``prompt`` (text; ``add_special_tokens`` default true) or ``messages`` (a chat,
rendered with the model's template; ``add_special_tokens`` default false, plus the chat
template fields: ``tools``, ``add_generation_prompt``, ``continue_final_message``,
``chat_template_kwargs``) and answers ``{count, max_model_len, tokens, token_strs}``.
/detokenize takes ``tokens`` and answers ``{prompt}``.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from pdserve.api.body import read_json_object
from pdserve.api.errors import bad_request, model_not_found, unrecognized_argument
from pdserve.api.prepare import render_chat
from pdserve.api.protocol import (
    ChatCompletionRequest,
    check_token_ids,
    parse_message,
    parse_template_options,
)
from pdserve.api.state import ApiContext, api_context
from pdserve.api.tools import parse_tools
from pdserve.api.validation import as_bool, as_list, as_str, optional, require

_COMMON_KEYS = {"model", "add_special_tokens", "return_token_strs"}
_CHAT_KEYS = _COMMON_KEYS | {
    "messages",
    "tools",
    "tool_choice",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
}


async def _body(request: web.Request, ctx: ApiContext) -> dict[str, Any]:
    config = ctx.config
    body = await read_json_object(request, config.max_body_bytes, config.body_read_timeout_s)
    model = body.get("model")
    if model is not None and as_str(model, "model") != config.served_model_name:
        raise model_not_found(model)
    return body


def _check_keys(body: dict[str, Any], allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise unrecognized_argument(key)


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize"""
    ctx = api_context(request)
    body = await _body(request, ctx)
    tokenizer = ctx.engine.tokenizer
    if body.get("messages") is not None:
        _check_keys(body, _CHAT_KEYS)
        items = as_list(body["messages"], "messages", non_empty=True)
        chat = ChatCompletionRequest(
            model=ctx.config.served_model_name,
            messages=[parse_message(m, f"messages[{i}]") for i, m in enumerate(items)],
            tools=parse_tools(body, ctx.config),
            template=parse_template_options(body),
        )
        text = render_chat(tokenizer, chat)
        add_special = as_bool(optional(body, "add_special_tokens", False), "add_special_tokens")
    else:
        _check_keys(body, _COMMON_KEYS | {"prompt"})
        text = as_str(require(body, "prompt"), "prompt", non_empty=True)
        add_special = as_bool(optional(body, "add_special_tokens", True), "add_special_tokens")
    if len(text) > ctx.config.max_body_bytes:
        raise bad_request("The prompt is too long to tokenize.", param="prompt")
    ids = tokenizer.encode(text, add_special_tokens=add_special)
    strs = None
    if as_bool(optional(body, "return_token_strs", False), "return_token_strs"):
        strs = [ctx.token_texts.text(t) for t in ids]
    return _json(
        {
            "count": len(ids),
            "max_model_len": ctx.engine.info.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
    )


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize"""
    ctx = api_context(request)
    body = await _body(request, ctx)
    _check_keys(body, {"model", "tokens"})
    tokenizer = ctx.engine.tokenizer
    raw = as_list(require(body, "tokens"), "tokens")
    ids = check_token_ids(raw, tokenizer.vocab_size, "tokens")
    return _json({"prompt": tokenizer.decode(ids)})


def _json(payload: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")
