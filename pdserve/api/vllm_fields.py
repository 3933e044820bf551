"""vLLM's request extensions: which ones pdserve honours, and the rule for each one it cannot.

Clients written against vLLM (guidellm, lm-eval, aiperf, vLLM's own benchmarks) send these
fields. pdserve parses and honours the meaningful ones; a field it cannot honour is accepted
only at its neutral value (what vLLM does when it is left out) and is otherwise a 400 naming the
field, so a client never silently gets something other than what it asked for. The tables
below list both (:data:`HONOURED`, :data:`IGNORED`, :data:`CONDITIONAL` and their chat twins);
README's "Structured outputs, tools and the vLLM extras" names the honoured ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdserve.api.errors import bad_request
from pdserve.api.validation import as_bool, as_int, as_str, is_int, optional

# name -> (is the value harmless, what we say when it is not)
Rule = tuple[Callable[[Any], bool], str]

MAX_CACHE_SALT_LEN = 1024  # vLLM's bound

# Honoured on both endpoints (parsed by parse_vllm_options or by their own modules).
HONOURED = frozenset(
    {
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "truncate_prompt_tokens",
        "truncation_side",
        "add_special_tokens",
        "prompt_logprobs",
        "return_token_ids",
        "return_tokens_as_token_ids",
        "cache_salt",
        "priority",
        "request_id",
    }
)
# Reasoning (api/reasoning.py): include_reasoning, and the thinking budget (with
# --reasoning-parser; without one, only its neutral -1).
CHAT_HONOURED = HONOURED | {"documents", "include_reasoning", "thinking_token_budget"}

# Accepted and without effect, as in vLLM: session identity (no per-session state here) and
# render-endpoint switches vLLM ignores on generation endpoints.
IGNORED = frozenset({"session_id", "return_token_offsets", "return_mm_kwargs"})
CHAT_IGNORED = IGNORED


def _is_empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _is_false(value: Any) -> bool:
    return value is None or value is False


# Not available here: accepted at the neutral value only (name -> (is harmless, why not)).
CONDITIONAL: dict[str, Rule] = {
    "use_beam_search": (_is_false, "beam search is not available"),
    "length_penalty": (
        lambda v: v is None or (v == 1 and not isinstance(v, bool)),
        "length_penalty only applies to beam search, which is not available",
    ),
    "watermarking": (_is_false, "watermarking is not available"),
    "allowed_token_ids": (_is_empty, "allowed_token_ids is not available; use logit_bias"),
    "bad_words": (_is_empty, "bad_words is not available; use logit_bias"),
    "logprob_token_ids": (_is_empty, "logprob_token_ids is not available; use logprobs"),
    "prompt_embeds": (_is_empty, "prompt embeddings are not available"),
    "vllm_xargs": (_is_empty, "there are no custom extensions to take vllm_xargs"),
    "ec_transfer_params": (_is_empty, "encoder-cache disaggregation is not available"),
    "repetition_detection": (_is_empty, "repetition detection is not available"),
    "routed_experts_prompt_start": (
        lambda v: v is None or (v == 0 and is_int(v)),
        "this model has no experts to report",
    ),
    "stream_interval": (
        lambda v: v is None or (v == 1 and is_int(v)),
        "every engine step is streamed as it comes (stream_interval 1)",
    ),
    "thinking_token_budget": (
        lambda v: v is None or (v == -1 and is_int(v)),
        "a thinking budget applies to chat completions (with --reasoning-parser)",
    ),
}
CHAT_CONDITIONAL: dict[str, Rule] = {
    **{k: v for k, v in CONDITIONAL.items() if k not in CHAT_HONOURED},
    "echo": (_is_false, "chat echo (prepending the last message) is not available"),
    "chat_template": (_is_empty, "a per-request chat template is not accepted"),
    "media_io_kwargs": (_is_empty, "media inputs are not available"),
    "mm_processor_kwargs": (_is_empty, "multimodal inputs are not available"),
    "return_prompt_text": (_is_false, "return_prompt_text is not available"),
}


def parse_vllm_options(
    body: dict[str, Any], opts: Any, max_top_logprobs: int, is_chat: bool
) -> None:
    """Fill ``opts`` (a :class:`~pdserve.api.options.RequestOptions`, typed loosely: options
    imports this module) from the honoured vLLM fields of ``body``."""
    opts.skip_special_tokens = as_bool(
        optional(body, "skip_special_tokens", True), "skip_special_tokens"
    )
    # Fast (Rust) tokenizers decode special tokens without spaces around them either way: vLLM
    # applies this flag only to slow tokenizers, which pdserve does not load.
    as_bool(optional(body, "spaces_between_special_tokens", True), "spaces_between_special_tokens")
    opts.include_stop_str_in_output = as_bool(
        optional(body, "include_stop_str_in_output", False), "include_stop_str_in_output"
    )
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None:
        # -1: the model's window (what is left after max_tokens is checked later anyway).
        value = as_int(truncate, "truncate_prompt_tokens", -1)
        opts.truncate_prompt_tokens = None if value == -1 else value
        if value == 0:
            raise bad_request(
                "'truncate_prompt_tokens' must be >= 1 or -1.", "truncate_prompt_tokens"
            )
    side = body.get("truncation_side")
    if side is not None:
        if side not in ("left", "right"):
            raise bad_request(
                "Invalid value for 'truncation_side': supported values are 'left' and 'right'.",
                param="truncation_side",
            )
        opts.truncation_side = side
    add_special = body.get("add_special_tokens")
    if add_special is not None:
        opts.add_special_tokens = as_bool(add_special, "add_special_tokens")
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None:
        opts.prompt_logprobs = as_int(prompt_logprobs, "prompt_logprobs", 0, max_top_logprobs)
    opts.return_tokens_as_token_ids = as_bool(
        optional(body, "return_tokens_as_token_ids", False), "return_tokens_as_token_ids"
    )
    salt = body.get("cache_salt")
    if salt is not None:
        opts.cache_salt = as_str(salt, "cache_salt", MAX_CACHE_SALT_LEN, non_empty=True)
    # Under --scheduling-policy priority lower values run first; fcfs (the default) ignores it.
    opts.priority = as_int(optional(body, "priority", 0), "priority", -(2**63), 2**63 - 1)
    if is_chat:
        _check_documents(body.get("documents"))


def _check_documents(value: Any) -> None:
    # The chat template receives them (RAG templates render them; others ignore them).
    if value is None:
        return
    if not isinstance(value, list) or not all(
        isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in value
    ):
        raise bad_request("'documents' must be an array of objects of strings.", "documents")
