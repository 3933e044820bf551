"""Generation options shared by chat and text completions, validated into RequestOptions."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.config import ApiConfig
from pdserve.api.errors import bad_request, unrecognized_argument
from pdserve.api.resume import parse_resume
from pdserve.api.structured import Constraint, allowing_extra_keys, parse_constraint
from pdserve.api.validation import (
    as_bool,
    as_float,
    as_int,
    as_list,
    as_object,
    as_str,
    optional,
    require,
)
from pdserve.api.vllm_fields import parse_vllm_options
from pdserve.engine.protocol import KVTransferParams, ResumeState
from pdserve.sampling_params import SamplingParams

MAX_ID_LEN = 128
ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(slots=True)
class RequestOptions:
    """Everything but the prompt: sampling, stopping, streaming and the PD hand-off."""

    max_tokens: int | None = None  # None: the window left after the prompt (capped by config)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    constraint: Constraint | None = None  # structured output
    echo: bool = False  # completions: the prompt text (and logprobs) before the completion
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    kv_transfer: KVTransferParams | None = None
    return_token_ids: bool = False  # replies name token ids (the router asks, to migrate)
    resume: ResumeState | None = None  # router: a migrated request's generated tokens
    # vLLM's extensions (pdserve.api.vllm_fields)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None  # keep this many prompt tokens
    truncation_side: str = "left"  # left: keep the last ones (vLLM's default)
    add_special_tokens: bool | None = None  # None: the endpoint's default
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (its own reply field)
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>"
    cache_salt: str | None = None
    priority: int = 0

    @property
    def is_scoring_only(self) -> bool:
        """``max_tokens: 0`` with echo: the prompt (and its logprobs), nothing generated.
        The engine still samples one token (its logits come with the prompt's); the reply
        leaves it out."""
        return self.max_tokens == 0

    @property
    def num_prompt_top_logprobs(self) -> int | None:
        """How many alternatives each prompt token's logprob entry needs, or None."""
        wanted = [self.prompt_logprobs] if self.prompt_logprobs is not None else []
        if self.echo and self.logprobs:
            wanted.append(self.top_logprobs)
        return max(wanted) if wanted else None

    def sampling_params(self, max_tokens: int, choice_index: int) -> SamplingParams:
        """Engine parameters for choice ``choice_index``: each choice gets its own seed."""
        return SamplingParams(
            max_tokens=max(1, max_tokens),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=None if self.seed is None else self.seed + choice_index,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logit_bias=self.logit_bias,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            prompt_logprobs=self.num_prompt_top_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            cache_salt=self.cache_salt,
        )


def is_valid_id(value: str) -> bool:
    """Request and room ids: 1..128 characters of ``[A-Za-z0-9._:-]``."""
    return ID_PATTERN.fullmatch(value) is not None


def parse_options(
    body: dict[str, Any], config: ApiConfig, vocab_size: int, is_chat: bool
) -> RequestOptions:
    """Validate the non-prompt fields of a chat or completion body."""
    opts = RequestOptions(
        max_tokens=_parse_max_tokens(body, is_chat),
        temperature=as_float(optional(body, "temperature", 1.0), "temperature", 0.0, 2.0),
        top_p=as_float(optional(body, "top_p", 1.0), "top_p", 0.0, 1.0, min_exclusive=True),
        top_k=as_int(optional(body, "top_k", 0), "top_k", min_value=-1),
        min_p=as_float(optional(body, "min_p", 0.0), "min_p", 0.0, 1.0),
        seed=_parse_seed(body),
        stop=parse_stop(body.get("stop"), config),
        stop_token_ids=_parse_stop_token_ids(body.get("stop_token_ids"), config, vocab_size),
        presence_penalty=_penalty(body, "presence_penalty"),
        frequency_penalty=_penalty(body, "frequency_penalty"),
        repetition_penalty=as_float(
            optional(body, "repetition_penalty", 1.0), "repetition_penalty", 0.0, 2.0, True
        ),
        ignore_eos=as_bool(optional(body, "ignore_eos", False), "ignore_eos"),
        min_tokens=as_int(optional(body, "min_tokens", 0), "min_tokens", 0),
        logit_bias=_parse_logit_bias(body.get("logit_bias"), config, vocab_size),
        constraint=allowing_extra_keys(
            parse_constraint(body, config.max_grammar_chars), config.json_allow_extra_keys
        ),
        n=as_int(optional(body, "n", 1), "n", 1, config.max_n),
        kv_transfer=parse_kv_transfer(body.get("kv_transfer_params")),
        return_token_ids=as_bool(optional(body, "return_token_ids", False), "return_token_ids"),
        resume=parse_resume(body.get("resume_params"), vocab_size),
    )
    if opts.max_tokens is not None and opts.min_tokens > opts.max_tokens:
        raise bad_request(
            f"'min_tokens' ({opts.min_tokens}) must be <= 'max_tokens' ({opts.max_tokens}).",
            param="min_tokens",
        )
    _parse_stream(body, opts)
    parse_vllm_options(body, opts, config.max_top_logprobs, is_chat)
    if is_chat:
        _parse_chat_logprobs(body, config, opts)
    else:
        _parse_completion_logprobs(body, config, opts)
        opts.echo = as_bool(optional(body, "echo", False), "echo")
    if opts.max_tokens == 0 and not opts.echo:
        raise bad_request(
            "'max_tokens' 0 is only allowed with 'echo' (prompt scoring).", param="max_tokens"
        )
    return opts


def _parse_max_tokens(body: dict[str, Any], is_chat: bool) -> int | None:
    # max_completion_tokens is OpenAI's newer name; when both are sent it wins.
    name = (
        "max_completion_tokens"
        if is_chat and body.get("max_completion_tokens") is not None
        else "max_tokens"
    )
    value = body.get(name)
    if value is None:
        return None
    # Completions: 0 with echo scores the prompt without generating (checked by the caller).
    return as_int(value, name, min_value=1 if is_chat else 0)


def _parse_seed(body: dict[str, Any]) -> int | None:
    value = body.get("seed")
    return None if value is None else as_int(value, "seed", INT64_MIN, INT64_MAX)


def _penalty(body: dict[str, Any], name: str) -> float:
    return as_float(optional(body, name, 0.0), name, -2.0, 2.0)


def parse_stop(value: Any, config: ApiConfig) -> list[str]:
    """``stop``: a string or an array of non-empty strings, bounded in count and length."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else as_list(value, "stop")
    if len(items) > config.max_stop_strings:
        raise bad_request(
            f"Too many stop sequences: {len(items)}, the maximum is {config.max_stop_strings}.",
            param="stop",
        )
    return [
        as_str(item, f"stop[{i}]", max_len=config.max_stop_len, non_empty=True)
        for i, item in enumerate(items)
    ]


def _parse_stop_token_ids(value: Any, config: ApiConfig, vocab_size: int) -> list[int]:
    if value is None:
        return []
    items = as_list(value, "stop_token_ids")
    if len(items) > config.max_stop_strings:
        raise bad_request(
            f"Too many stop_token_ids: {len(items)}, the maximum is {config.max_stop_strings}.",
            param="stop_token_ids",
        )
    return [as_int(v, f"stop_token_ids[{i}]", 0, vocab_size - 1) for i, v in enumerate(items)]


def _parse_logit_bias(value: Any, config: ApiConfig, vocab_size: int) -> dict[int, float]:
    """``{"token id": bias}``: ids (as strings, JSON keys) inside the vocabulary, biases in
    [-100, 100] (OpenAI's range; +-100 all but forces or bans the token)."""
    if value is None:
        return {}
    obj = as_object(value, "logit_bias")
    if len(obj) > config.max_logit_bias:
        raise bad_request(
            f"Too many logit_bias entries: {len(obj)}, the maximum is {config.max_logit_bias}.",
            param="logit_bias",
        )
    out: dict[int, float] = {}
    for key, bias in obj.items():
        param = f"logit_bias.{key}"
        if not key.isdigit() or len(key) > 12:  # no sign, no spaces: a plain token id
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}.", param=param)
        token = int(key)
        if token >= vocab_size:
            raise bad_request(
                f"'logit_bias' token id {token} is outside the vocabulary [0, {vocab_size}).",
                param=param,
            )
        out[token] = as_float(bias, param, -100.0, 100.0)
    return out


def _parse_stream(body: dict[str, Any], opts: RequestOptions) -> None:
    opts.stream = as_bool(optional(body, "stream", False), "stream")
    stream_options = body.get("stream_options")
    if stream_options is None:
        return
    if not opts.stream:
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    obj = as_object(stream_options, "stream_options")
    for key in obj:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise unrecognized_argument(f"stream_options.{key}")
    opts.include_usage = as_bool(
        optional(obj, "include_usage", False), "stream_options.include_usage"
    )
    # vLLM's extension (guidellm always sends it): usage on every chunk, with include_usage.
    continuous = as_bool(
        optional(obj, "continuous_usage_stats", False), "stream_options.continuous_usage_stats"
    )
    opts.continuous_usage = continuous and opts.include_usage


def _parse_chat_logprobs(body: dict[str, Any], config: ApiConfig, opts: RequestOptions) -> None:
    opts.logprobs = as_bool(optional(body, "logprobs", False), "logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return
    opts.top_logprobs = as_int(top, "top_logprobs", 0, config.max_top_logprobs)
    if not opts.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")


def _parse_completion_logprobs(
    body: dict[str, Any], config: ApiConfig, opts: RequestOptions
) -> None:
    # Completions: an int = how many alternatives per position; 0 still returns sampled logprobs.
    value = body.get("logprobs")
    if value is None:
        return
    opts.logprobs = True
    opts.top_logprobs = as_int(value, "logprobs", 0, config.max_top_logprobs)


def parse_kv_transfer(value: Any) -> KVTransferParams | None:
    """The router's PD hand-off: ``{room_id, bootstrap_host, bootstrap_port}``."""
    if value is None:
        return None
    obj = as_object(value, "kv_transfer_params")
    for key in obj:
        if key not in ("room_id", "bootstrap_host", "bootstrap_port"):
            raise unrecognized_argument(f"kv_transfer_params.{key}")
    room_id = as_str(
        require(obj, "room_id", "kv_transfer_params.room_id"), "kv_transfer_params.room_id"
    )
    if not is_valid_id(room_id):
        raise bad_request(
            f"'kv_transfer_params.room_id' must be 1..{MAX_ID_LEN} characters of [A-Za-z0-9._:-].",
            param="kv_transfer_params.room_id",
        )
    host_param = "kv_transfer_params.bootstrap_host"
    host = as_str(require(obj, "bootstrap_host", host_param), host_param, 253, non_empty=True)
    port_param = "kv_transfer_params.bootstrap_port"
    port = as_int(require(obj, "bootstrap_port", port_param), port_param, 1, 65535)
    return KVTransferParams(room_id=room_id, bootstrap_host=host, bootstrap_port=port)
