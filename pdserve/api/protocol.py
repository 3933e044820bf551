"""Request parsing: decoded JSON bodies -> validated dataclasses (no HTTP here).

Chat and text completion bodies are checked field by field (see :mod:`pdserve.api.fields` for the
OpenAI conventions on unknown fields); every failure is an :class:`~pdserve.api.errors.ApiError`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from pdserve.api import fields
from pdserve.api.config import ApiConfig
from pdserve.api.errors import bad_request, model_not_found, unrecognized_argument, unsupported
from pdserve.api.options import RequestOptions, is_valid_id, parse_options
from pdserve.api.reasoning import ReasoningOptions, parse_reasoning_options
from pdserve.api.structured import allowing_extra_keys
from pdserve.api.tools import ToolConfig, parse_tools
from pdserve.api.validation import as_bool, as_list, as_object, as_str, optional, require

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_call_id", "tool_calls", "refusal"})
_PROMPT_SHAPES = (
    "'prompt' must be a non-empty string, array of strings, array of token ids, "
    "or array of token-id arrays."
)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()  # assistant turns: calls as OpenAI sent them

    def to_template(self) -> dict[str, Any]:
        """The dict a chat template renders (``developer`` is OpenAI's newer ``system``)."""
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.content,
        }
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    # Templates (Hermes, Qwen, Llama 3) render arguments with tojson: give them the object.
    fn = call["function"]
    try:
        args: Any = orjson.loads(fn["arguments"])
    except orjson.JSONDecodeError:
        args = fn["arguments"]
    return {**call, "function": {"name": fn["name"], "arguments": args}}


@dataclass(frozen=True, slots=True)
class TemplateOptions:
    """How the conversation is rendered: vLLM's chat template extras."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs


@dataclass(slots=True)
class ChatCompletionRequest:
    model: str
    messages: list[ChatMessage]
    options: RequestOptions = field(default_factory=RequestOptions)
    tools: ToolConfig | None = None
    template: TemplateOptions = field(default_factory=TemplateOptions)
    reasoning: ReasoningOptions = field(default_factory=ReasoningOptions)


@dataclass(slots=True)
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]  # one entry per prompt of a batch: text or token ids
    options: RequestOptions = field(default_factory=RequestOptions)


def resolve_request_id(header: str | None, prefix: str, body_id: Any = None) -> str:
    """The client's ``X-Request-Id`` when valid (the router sets the same id on both legs),
    else vLLM's body field ``request_id``, else a new one."""
    if header is None and body_id is not None:
        if not isinstance(body_id, str) or not is_valid_id(body_id):
            raise bad_request(
                "'request_id' must be 1..128 characters of [A-Za-z0-9._:-].", param="request_id"
            )
        return body_id
    if header is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not is_valid_id(header):
        raise bad_request(
            "Header 'X-Request-Id' must be 1..128 characters of [A-Za-z0-9._:-].",
            param="X-Request-Id",
        )
    return header


def _check_model(body: dict[str, Any], config: ApiConfig) -> str:
    model = as_str(require(body, "model"), "model")
    if model != config.served_model_name:
        raise model_not_found(model)
    return model


def parse_chat_request(
    body: dict[str, Any], config: ApiConfig, vocab_size: int
) -> ChatCompletionRequest:
    """Validate a ``/v1/chat/completions`` body."""
    fields.check_fields(body, fields.CHAT_SUPPORTED, fields.CHAT_IGNORED, fields.CHAT_CONDITIONAL)
    model = _check_model(body, config)
    items = as_list(require(body, "messages"), "messages", non_empty=True)
    messages = [parse_message(m, f"messages[{i}]") for i, m in enumerate(items)]
    options = parse_options(body, config, vocab_size, is_chat=True)
    tools = parse_tools(body, config)
    constraint = tools.constraint() if tools is not None else None
    constraint = allowing_extra_keys(constraint, config.json_allow_extra_keys)
    if constraint is not None:
        assert tools is not None
        if options.constraint is not None:
            raise bad_request(
                f"'tool_choice' {tools.mode!r} cannot be combined with "
                f"'{options.constraint.param}'.",
                param="tool_choice",
            )
        options.constraint = constraint
    template = parse_template_options(body)
    if template.continue_final_message and messages[-1].role != "assistant":
        raise bad_request(
            "'continue_final_message' needs the last message to be from the assistant.",
            param="continue_final_message",
        )
    reasoning = parse_reasoning_options(body, config.reasoning_parser)
    return ChatCompletionRequest(model, messages, options, tools, template, reasoning)


_RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt"})


def parse_template_options(body: dict[str, Any]) -> TemplateOptions:
    """``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``."""
    add = as_bool(optional(body, "add_generation_prompt", True), "add_generation_prompt")
    cont = as_bool(optional(body, "continue_final_message", False), "continue_final_message")
    if add and cont and body.get("add_generation_prompt") is not None:
        raise bad_request(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true.",
            param="continue_final_message",
        )
    kwargs = as_object(optional(body, "chat_template_kwargs", {}), "chat_template_kwargs")
    for key in kwargs:
        if key in _RESERVED_TEMPLATE_VARS or not key.isidentifier():
            raise bad_request(
                f"'chat_template_kwargs.{key}' cannot be set there.",
                param=f"chat_template_kwargs.{key}",
            )
    extra = dict(kwargs)
    if body.get("documents") is not None:  # vLLM's RAG documents, a template variable
        extra["documents"] = body["documents"]
    return TemplateOptions(not cont and add, cont, extra)


def parse_completion_request(
    body: dict[str, Any], config: ApiConfig, vocab_size: int
) -> CompletionRequest:
    """Validate a ``/v1/completions`` body."""
    fields.check_fields(
        body,
        fields.COMPLETION_SUPPORTED,
        fields.COMPLETION_IGNORED,
        fields.COMPLETION_CONDITIONAL,
    )
    model = _check_model(body, config)
    prompts = parse_prompt(require(body, "prompt"), vocab_size)
    options = parse_options(body, config, vocab_size, is_chat=False)
    num_choices = len(prompts) * options.n
    if num_choices > config.max_n:
        raise bad_request(
            f"Too many choices: {len(prompts)} prompts x n={options.n} = {num_choices}, "
            f"the maximum is {config.max_n}.",
            param="n",
        )
    return CompletionRequest(model=model, prompts=prompts, options=options)


def parse_message(raw: Any, param: str) -> ChatMessage:
    obj = as_object(raw, param)
    for key in obj:
        if key not in _MESSAGE_KEYS:
            raise unrecognized_argument(f"{param}.{key}")
    role = as_str(require(obj, "role", f"{param}.role"), f"{param}.role")
    if role not in CHAT_ROLES:
        raise bad_request(
            f"Invalid value for '{param}.role': '{role}'. Supported values are: "
            f"{', '.join(sorted(CHAT_ROLES))}.",
            param=f"{param}.role",
        )
    tool_calls = _parse_message_tool_calls(obj.get("tool_calls"), role, f"{param}.tool_calls")
    content = obj.get("content")
    if content is None and role != "assistant":
        raise bad_request(f"Missing required parameter: '{param}.content'.", f"{param}.content")
    name = obj.get("name")
    tool_call_id = obj.get("tool_call_id")
    return ChatMessage(
        role=role,
        content="" if content is None else parse_content(content, f"{param}.content"),
        name=None if name is None else as_str(name, f"{param}.name"),
        tool_call_id=None
        if tool_call_id is None
        else as_str(tool_call_id, f"{param}.tool_call_id"),
        tool_calls=tool_calls,
    )


def _parse_message_tool_calls(value: Any, role: str, param: str) -> tuple[dict[str, Any], ...]:
    """An assistant turn's ``tool_calls``: ``[{id, type: function, function{name, arguments}}]``."""
    if value is None or value == []:
        return ()
    if role != "assistant":
        raise bad_request(f"'{param}' is only allowed on assistant messages.", param=param)
    calls = []
    for i, raw in enumerate(as_list(value, param)):
        p = f"{param}[{i}]"
        call = as_object(raw, p)
        for key in call:
            if key not in ("id", "type", "function"):
                raise unrecognized_argument(f"{p}.{key}")
        call_id = as_str(require(call, "id", f"{p}.id"), f"{p}.id", 128)
        if as_str(optional(call, "type", "function"), f"{p}.type") != "function":
            raise bad_request(f"'{p}.type' must be 'function'.", param=f"{p}.type")
        fn = as_object(require(call, "function", f"{p}.function"), f"{p}.function")
        name = as_str(require(fn, "name", f"{p}.function.name"), f"{p}.function.name", 64)
        args = as_str(optional(fn, "arguments", "{}"), f"{p}.function.arguments")
        calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        )
    return tuple(calls)


def parse_content(value: Any, param: str) -> str:
    """A string, or a non-empty array of text parts (joined by newlines)."""
    if isinstance(value, str):
        return value
    parts = as_list(value, param, non_empty=True)
    texts = []
    for i, raw in enumerate(parts):
        part_param = f"{param}[{i}]"
        part = as_object(raw, part_param)
        part_type = as_str(require(part, "type", f"{part_param}.type"), f"{part_param}.type")
        if part_type != "text":
            raise unsupported(f"{part_param}.type", f"content parts of type '{part_type}'")
        for key in part:
            if key not in ("type", "text"):
                raise unrecognized_argument(f"{part_param}.{key}")
        texts.append(as_str(require(part, "text", f"{part_param}.text"), f"{part_param}.text"))
    return "\n".join(texts)


def parse_prompt(value: Any, vocab_size: int) -> list[str | list[int]]:
    """Normalize the four OpenAI prompt shapes into a batch of texts or token-id lists."""
    if isinstance(value, str):
        if not value:
            raise bad_request("'prompt' must not be empty.", param="prompt")
        return [value]
    items = as_list(value, "prompt", non_empty=True)
    kinds = set(map(type, items))
    if kinds == {int}:
        return [check_token_ids(items, vocab_size, "prompt")]
    if kinds == {str}:
        if not all(items):
            raise bad_request("'prompt' must not contain empty strings.", param="prompt")
        return list(items)
    if kinds == {list}:
        return [check_token_ids(p, vocab_size, f"prompt[{i}]") for i, p in enumerate(items)]
    raise bad_request(_PROMPT_SHAPES, param="prompt")


def check_token_ids(ids: list[Any], vocab_size: int, param: str) -> list[int]:
    """Token ids: a non-empty list of ints (bools excluded) inside the vocabulary."""
    if not ids:
        raise bad_request(f"'{param}' must not be empty.", param=param)
    # map/min/max run in C: no Python-level loop over a possibly long id list.
    if set(map(type, ids)) != {int}:
        raise bad_request(f"'{param}' must contain only integer token ids.", param=param)
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        raise bad_request(
            f"'{param}' has token ids outside the vocabulary [0, {vocab_size}): "
            f"min {low}, max {high}.",
            param=param,
        )
    return ids
