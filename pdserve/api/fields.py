"""Which top-level request fields each endpoint accepts, ignores, or refuses (OpenAI conventions).

- supported: parsed and honoured;
- ignored: OpenAI fields with no effect on generation here (accepted, dropped);
- conditional: OpenAI fields we can only honour at their neutral value; anything else is a 400
  naming the field, so a client never silently gets something other than what it asked for;
- anything else: ``Unrecognized request argument supplied: <name>`` (what OpenAI answers).
"""

from __future__ import annotations

from typing import Any

from pdserve.api import vllm_fields
from pdserve.api.errors import unrecognized_argument, unsupported
from pdserve.api.reasoning import REASONING_FIELDS
from pdserve.api.resume import RESUME_FIELDS
from pdserve.api.structured import GUIDED_FIELDS, GUIDED_IGNORED

# Extensions beyond OpenAI that vLLM-style clients and the router send.
_EXTENSIONS = frozenset(
    {
        "top_k",
        "min_p",
        "min_tokens",
        "repetition_penalty",
        "ignore_eos",
        "stop_token_ids",
        "kv_transfer_params",
        "structured_outputs",
        *GUIDED_FIELDS,
        *RESUME_FIELDS,
    }
)
_COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "response_format",
    }
)
CHAT_SUPPORTED = (
    _COMMON
    | _EXTENSIONS
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template_kwargs",
        "continue_final_message",
        "add_generation_prompt",
    }
    | vllm_fields.CHAT_HONOURED
    | REASONING_FIELDS  # thinking_token_budget (vLLM), thinking_budget (SGLang), ...
)
COMPLETION_SUPPORTED = _COMMON | _EXTENSIONS | {"prompt", "echo"} | vllm_fields.HONOURED

CHAT_IGNORED = frozenset(
    {
        "user",
        "store",
        "metadata",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
    }
)
CHAT_IGNORED |= GUIDED_IGNORED | vllm_fields.CHAT_IGNORED
COMPLETION_IGNORED = frozenset({"user"}) | GUIDED_IGNORED | vllm_fields.IGNORED


def _is_empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


Rule = vllm_fields.Rule

CHAT_CONDITIONAL: dict[str, Rule] = {
    "functions": (_is_empty, "the deprecated 'functions' field is not available; use 'tools'"),
    "function_call": (
        lambda v: v in (None, "none"),
        "the deprecated 'function_call' field is not available; use 'tool_choice'",
    ),
    "modalities": (lambda v: v is None or v == ["text"], "only ['text'] is accepted"),
    "audio": (lambda v: v is None, "audio output is not available"),
    "prediction": (lambda v: v is None, "predicted outputs are not available"),
    "reasoning_effort": (lambda v: v is None, "this model has no reasoning effort setting"),
    "web_search_options": (lambda v: v is None, "web search is not available"),
    "verbosity": (lambda v: v is None, "this model has no verbosity setting"),
    **vllm_fields.CHAT_CONDITIONAL,
}
COMPLETION_CONDITIONAL: dict[str, Rule] = {
    "best_of": (
        lambda v: v is None or (v == 1 and not isinstance(v, bool)),
        "only best_of=1 is accepted",
    ),
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not available"),
    **vllm_fields.CONDITIONAL,
}


def check_fields(
    body: dict[str, Any],
    supported: frozenset[str],
    ignored: frozenset[str],
    conditional: dict[str, Rule],
) -> None:
    """Raise the OpenAI-style 400 for the first field that is unknown or cannot be honoured."""
    for name, value in body.items():
        if name in supported or name in ignored:
            continue
        rule = conditional.get(name)
        if rule is None:
            raise unrecognized_argument(name)
        is_harmless, detail = rule
        if not is_harmless(value):
            raise unsupported(name, detail)
