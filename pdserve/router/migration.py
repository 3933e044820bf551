"""Request migration: when a decode worker dies mid-stream, the router resumes the request on
another path and the client's stream simply continues.

A :class:`StreamTracker` sits between the primary leg and the client for every stream that may
migrate. Workers are asked for the token ids of each chunk (``return_token_ids``); the tracker
takes them out of the chunks, counts the text the client received, and keeps the stream's
``id``/``created`` the same across workers. On a break, :func:`resume_body` asks the next
worker to continue after exactly those tokens (``resume_params``): they are placed after the
prompt as generated tokens, so ``max_tokens``, penalties and the seeded noise positions
continue where the dead worker stopped, and a seeded or greedy continuation is the one the
dead worker would have produced.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

logger = logging.getLogger(__name__)

_EVENT_END = b"\n\n"
_DONE = b"[DONE]"


def is_migratable(path: str, body: dict[str, Any]) -> bool:
    """A streamed request with one choice whose chunks the tracker can follow exactly (no
    echo, no tool-call parsing that rewrites the text)."""
    if body.get("stream") is not True or body.get("n") not in (None, 1):
        return False
    if body.get("tools") or body.get("echo") or "resume_params" in body:
        return False
    if path.endswith("/chat/completions"):
        return True
    prompt = body.get("prompt")
    if isinstance(prompt, list):  # a list of ids is one prompt; a list of prompts is a batch
        return all(isinstance(p, int) for p in prompt) or len(prompt) == 1
    return isinstance(prompt, str)


def first_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body of a migratable request's first attempt: chunks name their token ids."""
    return {**body, "return_token_ids": True}


@dataclass(eq=False)
class StreamTracker:
    """What one client stream has received so far, across every worker that served it."""

    is_chat: bool
    keep_token_ids: bool = False  # the client asked for return_token_ids itself
    out: web.StreamResponse | None = None  # the client's response once prepared
    status: int = 200
    token_ids: list[int] = field(default_factory=list)
    num_text_chars: int = 0
    stream_id: Any = None
    created: Any = None
    num_migrations: int = 0
    is_finished: bool = False  # a finish_reason reached the client
    saw_done: bool = False
    saw_error: bool = False  # the worker itself ended the stream with an error event
    is_exact: bool = True  # every chunk with text named its token ids

    @property
    def can_resume(self) -> bool:
        """Whether a continuation can be exact: nothing ended the stream on purpose."""
        return self.is_exact and not (self.is_finished or self.saw_done or self.saw_error)

    def resume_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The request again, continuing after the tokens the client already has."""
        resume = {"token_ids": list(self.token_ids), "num_text_chars": self.num_text_chars}
        return {**first_body(body), "resume_params": resume}

    def filter(self, data: bytes) -> bytes:
        """The complete events of ``data`` as the client must see them (a trailing partial
        event is dropped: only a dying worker leaves one)."""
        events = data.split(_EVENT_END)
        kept = []
        for event in events[:-1]:
            out = self._event(event)
            if out is not None:
                kept.append(out + _EVENT_END)
        return b"".join(kept)

    def _event(self, event: bytes) -> bytes | None:
        if not event.startswith(b"data:"):
            return event if event.strip() else None
        payload = event[5:].strip()
        if payload == _DONE:
            self.saw_done = True
            return event
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.is_exact = False
            return event
        if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
            self.saw_error = self.saw_error or (isinstance(obj, dict) and "error" in obj)
            return event
        if not self.keep_token_ids or self.num_migrations:  # the client has them once
            obj.pop("prompt_token_ids", None)
        if self.stream_id is None:
            self.stream_id, self.created = obj.get("id"), obj.get("created")
        else:
            obj["id"], obj["created"] = self.stream_id, self.created
        keep = not obj["choices"]  # the usage chunk
        for choice in obj["choices"]:
            keep = self._choice(choice) or keep
        return b"data: " + orjson.dumps(obj) if keep else None

    def _choice(self, choice: dict[str, Any]) -> bool:
        """Record one choice; whether it carries anything for the client."""
        ids = choice.get("token_ids") if self.keep_token_ids else choice.pop("token_ids", None)
        if not self.keep_token_ids or self.num_migrations:
            choice.pop("prompt_token_ids", None)
        delta = choice.get("delta") if self.is_chat else None
        text = (delta or {}).get("content") if self.is_chat else choice.get("text")
        if isinstance(ids, list):
            self.token_ids.extend(ids)
        elif text:
            self.is_exact = False  # a worker that does not name its tokens
        if text:
            self.num_text_chars += len(text)
        if (delta or {}).get("reasoning_content"):
            # The worker's reasoning parser rewrote the text (tags out, the thinking apart):
            # the characters the client has are no longer offsets into it to resume from.
            self.is_exact = False
        is_opening = bool(delta) and "role" in delta
        if choice.get("finish_reason") is not None:
            self.is_finished = True
            return True
        if is_opening:  # the role chunk opens the stream once, not on every worker
            return self.num_migrations == 0
        if ids and self.keep_token_ids:
            return True
        return bool(text) or bool(choice.get("logprobs")) or bool(delta)
