"""How many tokens a request's prompt is, as the router's admission check needs it.

The router has no tokenizer. Token ids are counted exactly; a text prompt gets bounds: at least
0 tokens, at most its UTF-8 bytes (a byte-level BPE token, and a SentencePiece byte-fallback
one, covers at least one byte) plus a few special tokens, and for a chat the bytes of its
messages and tools plus a template's slack. A ``/v1/responses`` body counts as
the chat it stands for. When the bounds do not decide (the check admits
with the upper and refuses with neither), the router asks a worker's ``POST /tokenize``: one
call, only near capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

SPECIAL_SLACK_TOKENS = 8  # BOS and the like, added to a text prompt
TEMPLATE_SLACK_TOKENS = 512  # a chat template's own text (roles, markers, a system prompt)
_CHAT_TEMPLATE_KEYS = ("tools", "add_generation_prompt", "continue_final_message",
                       "chat_template_kwargs")  # fmt: skip
# /v1/responses input roles as the worker maps them (api/responses_api.py)
_RESPONSES_ROLES = {"developer": "system"}


@dataclass(frozen=True, slots=True)
class PromptBounds:
    """``low <= tokens <= high``; equal when counted exactly."""

    low: int
    high: int

    @property
    def is_exact(self) -> bool:
        return self.low == self.high


def conversation(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The messages a chat, or a ``/v1/responses`` body (``input`` as a string or message
    items, ``instructions`` as a system message first, as the worker renders it), stands for;
    None for a completion. Lenient: a shape the worker will refuse is its 400 to give."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return messages
    if "input" not in body:
        return None
    value = body["input"]
    items: list[Any] = [{"role": "user", "content": value}] if isinstance(value, str) else value
    if not isinstance(items, list):
        return []
    out = [_input_message(m) for m in items if isinstance(m, dict)]
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        out.insert(0, {"role": "system", "content": instructions})
    return out


def _input_message(item: dict[str, Any]) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    if isinstance(content, list):  # input_text / output_text parts: their text, as rendered
        content = "".join(part_texts(content))
    if isinstance(role, str):
        role = _RESPONSES_ROLES.get(role, role)
    return {"role": role, "content": content}


def part_texts(parts: list[Any]) -> list[str]:
    """The string texts of content parts (anything else is the worker's 400)."""
    return [p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]


def prompt_bounds(body: dict[str, Any]) -> PromptBounds:
    """Bounds on a completion's, chat's or response's prompt tokens (a batch's summed: every
    prompt holds KV at once); (0, 0) for a shape the worker will refuse anyway (its 400, not
    the router's)."""
    messages = conversation(body)
    if messages is not None:
        if not messages:
            return PromptBounds(0, 0)
        size = len(orjson.dumps(messages)) + len(orjson.dumps(body.get("tools")))
        return PromptBounds(0, size + TEMPLATE_SLACK_TOKENS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return PromptBounds(len(prompt), len(prompt))  # one prompt of token ids
    prompts = batch_prompts(body)
    if prompts is None:
        return PromptBounds(0, 0)
    low = high = 0
    for p in prompts:
        if isinstance(p, str):
            high += len(p.encode()) + SPECIAL_SLACK_TOKENS
        else:
            low, high = low + len(p), high + len(p)
    return PromptBounds(low, high)


def batch_prompts(body: dict[str, Any]) -> list[str | list[int]] | None:
    """A completion's prompts: one text, or a batch of texts and token-id lists (a single
    list of ids is one prompt: not here); None for any other shape."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt or type(prompt[0]) is int:
        return None
    if all(isinstance(p, str) or (isinstance(p, list) and _is_ids(p)) for p in prompt):
        return prompt
    return None


def _is_ids(value: list[Any]) -> bool:
    return bool(value) and all(type(t) is int for t in value)


def num_prompts(body: dict[str, Any]) -> int:
    """How many prompts a request sends (a completion's batch; else one)."""
    prompts = batch_prompts(body)
    return len(prompts) if prompts else 1


def tokenize_request(body: dict[str, Any]) -> dict[str, Any] | None:
    """The ``POST /tokenize`` body that counts this request's prompt as its worker will, or
    None where asking is not worth it (a batch of prompts, exact ids, an odd shape)."""
    messages = conversation(body)
    if messages:
        extra = {k: body[k] for k in _CHAT_TEMPLATE_KEYS if k in body}
        return {"messages": messages, **extra}
    prompt = body.get("prompt")
    return {"prompt": prompt} if isinstance(prompt, str) and prompt else None


def count_from_reply(raw: bytes) -> int | None:
    """The token count of a ``/tokenize`` answer (vLLM's shape), or None if it has none."""
    try:
        count = orjson.loads(raw).get("count")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return count if type(count) is int and count >= 0 else None
