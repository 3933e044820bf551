"""How many tokens a request's prompt is, as the router's admission check needs it.

The router has no tokenizer. Token ids are counted exactly; a text prompt gets bounds: at least
0 tokens, at most its UTF-8 bytes (a byte-level BPE token, and a SentencePiece byte-fallback
one, covers at least one byte) plus a few special tokens, and for a chat the bytes of its
messages and tools plus a template's slack. When the bounds do not decide (the check admits
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


@dataclass(frozen=True, slots=True)
class PromptBounds:
    """``low <= tokens <= high``; equal when counted exactly."""

    low: int
    high: int

    @property
    def is_exact(self) -> bool:
        return self.low == self.high


def prompt_bounds(body: dict[str, Any]) -> PromptBounds:
    """Bounds on a completion's or chat's prompt tokens; (0, 0) for a shape the worker will
    refuse anyway (its 400, not the router's)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        size = len(orjson.dumps(messages)) + len(orjson.dumps(body.get("tools")))
        return PromptBounds(0, size + TEMPLATE_SLACK_TOKENS)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return PromptBounds(0, len(prompt.encode()) + SPECIAL_SLACK_TOKENS)
    if isinstance(prompt, list) and prompt:
        if all(type(t) is int for t in prompt):
            return PromptBounds(len(prompt), len(prompt))
        if all(isinstance(p, str) for p in prompt):  # a batch: every prompt holds KV at once
            high = sum(len(p.encode()) + SPECIAL_SLACK_TOKENS for p in prompt)
            return PromptBounds(0, high)
    return PromptBounds(0, 0)


def tokenize_request(body: dict[str, Any]) -> dict[str, Any] | None:
    """The ``POST /tokenize`` body that counts this request's prompt as its worker will, or
    None where asking is not worth it (a batch of prompts, exact ids, an odd shape)."""
    messages = body.get("messages")
    if isinstance(messages, list):
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
