"""Validated requests -> engine requests: chat template, tokenization, context window, ids.

Choice ``i`` of a request with several choices (n > 1 or a batch of prompts) is its own engine
request ``f"{rid}-{i}"`` with room ``f"{room_id}-{i}"``: both PD legs parse the same body and so
derive the same ids without talking to each other.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.api.config import ApiConfig
from pdserve.api.errors import bad_request
from pdserve.api.options import RequestOptions
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.api.resume import check_resume_budget
from pdserve.engine.protocol import GenerateRequest, KVTransferParams, TokenizerLike

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PreparedRequest:
    """What a handler runs: one engine request per choice, plus what responses need."""

    request_id: str
    model: str
    created: int
    options: RequestOptions
    prompt_lens: list[int]  # per prompt of the batch
    engine_requests: list[GenerateRequest]  # index = choice index
    echo_texts: list[str] | None = None  # completions with echo: each prompt's text

    def echo_text(self, choice_index: int) -> str:
        """The prompt text choice ``choice_index`` starts with ('' without echo)."""
        if self.echo_texts is None:
            return ""
        return self.echo_texts[choice_index // self.options.n]

    @property
    def num_choices(self) -> int:
        return len(self.engine_requests)


async def _run_maybe_offloop(
    config: ApiConfig, num_chars: int, fn: Callable[[], list[int]]
) -> list[int]:
    # Tokenizing megabytes of text takes long enough to stall heartbeats and other streams.
    if num_chars <= config.max_inline_tokenize_chars:
        return fn()
    return await asyncio.get_running_loop().run_in_executor(None, fn)


def render_chat(tokenizer: TokenizerLike, request: ChatCompletionRequest) -> str:
    """The prompt text of a conversation, with its tools and template options."""
    messages = [m.to_template() for m in request.messages]
    template = request.template
    extra = dict(template.kwargs)
    if request.tools is not None and request.tools.template_tools is not None:
        extra["tools"] = request.tools.template_tools
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=template.add_generation_prompt, **extra
        )
    except Exception as exc:  # the template's complaints are about the client's messages
        logger.info("chat template rejected messages: %s", exc)
        raise bad_request(f"Could not apply the chat template: {exc}", param="messages") from exc
    if template.continue_final_message:
        # Cut what the template closes the last turn with, so the model continues it.
        final = messages[-1]["content"]
        end = text.rfind(final) if final else -1
        if end < 0:
            raise bad_request(
                "The chat template does not render the final message's content as is, so it "
                "cannot be continued.",
                param="continue_final_message",
            )
        text = text[: end + len(final)]
    return text


def _render_and_encode(tokenizer: TokenizerLike, request: ChatCompletionRequest) -> list[int]:
    text = render_chat(tokenizer, request)
    # The template already holds any BOS it wants; adding special tokens would double it
    # (vLLM's add_special_tokens asks for it anyway).
    add_special = bool(request.options.add_special_tokens)
    return truncate(tokenizer.encode(text, add_special_tokens=add_special), request.options)


def truncate(ids: list[int], options: RequestOptions) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep that many tokens, the last ones by default."""
    keep = options.truncate_prompt_tokens
    if keep is None or len(ids) <= keep:
        return ids
    return ids[:keep] if options.truncation_side == "right" else ids[-keep:]


async def prepare_chat(
    request: ChatCompletionRequest,
    request_id: str,
    tokenizer: TokenizerLike,
    max_model_len: int,
    config: ApiConfig,
) -> PreparedRequest:
    """Render and tokenize the conversation, then build one engine request per choice."""
    num_chars = sum(len(m.content) for m in request.messages)
    ids = await _run_maybe_offloop(
        config, num_chars, lambda: _render_and_encode(tokenizer, request)
    )
    return _build(
        request_id, request.model, [ids], request.options, max_model_len, config, "messages"
    )


async def prepare_completion(
    request: CompletionRequest,
    request_id: str,
    tokenizer: TokenizerLike,
    max_model_len: int,
    config: ApiConfig,
) -> PreparedRequest:
    """Tokenize each text prompt of the batch, then build one engine request per choice."""
    options = request.options
    add_special = options.add_special_tokens is not False
    prompts: list[list[int]] = []
    echo_texts: list[str] = []
    for prompt in request.prompts:
        if isinstance(prompt, str):
            encode = functools.partial(tokenizer.encode, prompt, add_special_tokens=add_special)
            ids = await _run_maybe_offloop(config, len(prompt), encode)
        else:
            ids = prompt
        kept = truncate(ids, options)
        prompts.append(kept)
        if options.echo:
            # A text prompt echoes as sent; token ids (and a cut prompt) as their text with
            # special tokens, which agrees with the logprobs' tokens and text_offset.
            is_as_sent = isinstance(prompt, str) and len(kept) == len(ids)
            echo_texts.append(prompt if is_as_sent else tokenizer.decode(kept, False))
    prepared = _build(request_id, request.model, prompts, options, max_model_len, config, "prompt")
    if options.echo:
        prepared.echo_texts = echo_texts
    return prepared


def resolve_max_tokens(
    num_prompt_tokens: int,
    requested: int | None,
    max_model_len: int,
    default_max_tokens: int,
    param: str,
) -> int:
    """Tokens this prompt may generate; 400 with the numbers when the window is exceeded."""
    if num_prompt_tokens == 0:
        raise bad_request(f"The {param} resulted in an empty prompt.", param=param)
    remaining = max_model_len - num_prompt_tokens
    if remaining <= 0:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{param} resulted in {num_prompt_tokens} tokens, leaving no room for the completion. "
            f"Please reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )
    if requested is None:
        return min(default_max_tokens, remaining)
    if requested > remaining:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"{param}, {requested} in the completion). Please reduce the length of the "
            f"{param} or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def _build(
    request_id: str,
    model: str,
    prompts: list[list[int]],
    options: RequestOptions,
    max_model_len: int,
    config: ApiConfig,
    param: str,
) -> PreparedRequest:
    budgets = [
        resolve_max_tokens(
            len(p), options.max_tokens, max_model_len, config.default_max_tokens, param
        )
        for p in prompts
    ]
    if options.min_tokens > min(budgets):
        raise bad_request(
            f"'min_tokens' ({options.min_tokens}) is more than the {min(budgets)} tokens this "
            "request may generate.",
            param="min_tokens",
        )
    num_choices = len(prompts) * options.n
    check_resume_budget(options.resume, min(budgets), num_choices)
    engine_requests = []
    for i in range(num_choices):
        prompt_index = i // options.n  # OpenAI orders choices prompt-major
        engine_requests.append(
            GenerateRequest(
                request_id=choice_id(request_id, i, num_choices),
                prompt_token_ids=prompts[prompt_index],
                sampling=options.sampling_params(budgets[prompt_index], i),
                kv_transfer=_choice_kv(options.kv_transfer, i, num_choices),
                deadline_s=config.request_deadline_s,
                resume=options.resume,
                priority=options.priority,
            )
        )
    return PreparedRequest(
        request_id=request_id,
        model=model,
        created=int(time.time()),
        options=options,
        prompt_lens=[len(p) for p in prompts],
        engine_requests=engine_requests,
    )


def choice_id(base_id: str, index: int, num_choices: int) -> str:
    """Engine request / room id of choice ``index``: the base id itself for a single choice."""
    return base_id if num_choices == 1 else f"{base_id}-{index}"


def _choice_kv(
    kv: KVTransferParams | None, index: int, num_choices: int
) -> KVTransferParams | None:
    if kv is None:
        return None
    return KVTransferParams(
        room_id=choice_id(kv.room_id, index, num_choices),
        bootstrap_host=kv.bootstrap_host,
        bootstrap_port=kv.bootstrap_port,
    )
