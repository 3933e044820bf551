"""POST /v1/responses, the basics of OpenAI's Responses API: text in (``input`` as a string or
as messages, ``instructions``), text out (one assistant message of ``output_text``), plain or
streamed as semantic events. The request becomes a chat completion (the same template, sampling
and engine path) and its answer is reshaped; pdserve stores nothing, so fields that need a
stored response or hosted tools are refused with a 400 naming them."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pdserve.api.errors import bad_request, unrecognized_argument, unsupported
from pdserve.api.prepare import PreparedRequest
from pdserve.api.responses import ChatResponseBuilder, ResponseBuilder
from pdserve.engine.protocol import GenerateOutput

# Passed to the chat request under the same name (its parser checks their values);
# ``kv_transfer_params`` is what the router adds for the legs of a PD pair.
_SAME_NAME = ("model", "temperature", "top_p", "stream", "user", "metadata", "kv_transfer_params")
# Accepted without effect: nothing is stored, and the only output format is text.
_NO_EFFECT = ("store", "parallel_tool_calls", "truncation", "background", "service_tier")
_DEFAULTS_ONLY: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "tool_choice": ("auto", "none"), "text": ({"format": {"type": "text"}},),
    "previous_response_id": (None,), "include": (None, []), "reasoning": (None,),
}  # fmt: skip
_INPUT_ROLES = {"user": "user", "assistant": "assistant", "system": "system",
                "developer": "system"}  # fmt: skip
_TEXT_PARTS = ("input_text", "output_text", "text")


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions request a Responses request stands for."""
    for name, value in body.items():
        if name in _DEFAULTS_ONLY:
            if value not in _DEFAULTS_ONLY[name]:
                raise unsupported(name, "pdserve's /v1/responses serves text in, text out")
        elif name not in (*_SAME_NAME, *_NO_EFFECT, "input", "instructions", "max_output_tokens"):
            raise unrecognized_argument(name)
    if "input" not in body:
        raise bad_request("'input' is required.", param="input")
    messages = _messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string.", param="instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {k: body[k] for k in _SAME_NAME if k in body}
    chat["messages"] = messages
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise bad_request(
                "'max_output_tokens' must be a positive integer.", "max_output_tokens"
            )
        chat["max_tokens"] = limit
    if body.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}  # response.completed carries usage
    return chat


def _messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty list of messages.", "input")
    out = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise unsupported(param, "only message items (role and content) are served")
        role = _INPUT_ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise bad_request(f"'{param}.role' must be one of {sorted(_INPUT_ROLES)}.", param)
        out.append({"role": role, "content": _text(item.get("content"), param)})
    return out


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{param}.content' must be a string or a list of parts.", param)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise unsupported(f"{param}.content", "only text parts are served")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"'{param}.content' text parts need a string 'text'.", param)
        texts.append(text)
    return "".join(texts)


class ResponsesBuilder(ResponseBuilder):
    """Reshapes a chat completion into a Responses object, or its chunks into Responses
    events (created, in progress, item and part opened, text deltas, then the closing ones)."""

    def __init__(self, inner: ChatResponseBuilder, body: dict[str, Any]) -> None:
        self.inner = inner
        self.prepared: PreparedRequest = inner.prepared
        self._body = body
        self._created = int(time.time())
        self._item_id = f"msg_{uuid.uuid4().hex}"
        self._seq = 0
        self._text: list[str] = []
        self._finish: str | None = None

    def add(self, index: int, out: GenerateOutput) -> None:
        self.inner.add(index, out)

    def response(self) -> dict[str, Any]:
        chat = self.inner.response()
        choice = chat["choices"][0]
        return self._object(choice["message"].get("content") or "", choice["finish_reason"])

    def opening_chunks(self) -> list[dict[str, Any]]:
        opened = self._object("", None, status="in_progress")
        item = {**self._message(""), "status": "in_progress", "content": []}
        return [
            self._event("response.created", response=opened),
            self._event("response.in_progress", response=opened),
            self._event("response.output_item.added", output_index=0, item=item),
            self._event(
                "response.content_part.added",
                item_id=self._item_id,
                output_index=0,
                content_index=0,
                part=_part(""),
            ),  # fmt: skip
        ]

    def chunk(self, index: int, out: GenerateOutput) -> dict[str, Any] | None:
        chunk = self.inner.chunk(index, out)
        if out.finish_reason is not None:
            self._finish = out.finish_reason
        text = chunk["choices"][0]["delta"].get("content") if chunk and chunk["choices"] else None
        if not text:
            return None
        self._text.append(text)
        return self._event("response.output_text.delta", item_id=self._item_id, output_index=0,
                           content_index=0, delta=text, logprobs=[])  # fmt: skip

    def closing_chunks(self) -> list[dict[str, Any]]:
        text = "".join(self._text)
        done = self._object(text, self._finish)
        return [
            self._event("response.output_text.done", item_id=self._item_id, output_index=0,
                        content_index=0, text=text, logprobs=[]),
            self._event("response.content_part.done", item_id=self._item_id, output_index=0,
                        content_index=0, part=_part(text)),
            self._event("response.output_item.done", output_index=0, item=done["output"][0]),
            self._event(f"response.{done['status']}", response=done),
        ]  # fmt: skip

    def _add_logprobs(self, index: int, out: GenerateOutput) -> None:
        raise AssertionError("the inner builder records logprobs")

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _message(self, text: str) -> dict[str, Any]:
        return {"type": "message", "id": self._item_id, "role": "assistant",
                "status": "completed", "content": [_part(text)]}  # fmt: skip

    def _object(self, text: str, finish: str | None, status: str | None = None) -> dict[str, Any]:
        incomplete = finish == "length"
        if status is None:
            status = "incomplete" if incomplete else "completed"
        message = {**self._message(text), "status": status}
        body = self._body
        usage = self.inner.usage()
        return {
            "id": self.prepared.request_id, "object": "response", "created_at": self._created,
            "status": status, "model": body.get("model"), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.get("instructions"),
            "output": [] if status == "in_progress" else [message],
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": [], "tool_choice": "auto", "parallel_tool_calls": True,
            "metadata": body.get("metadata") or {}, "text": {"format": {"type": "text"}},
            "usage": None if status == "in_progress" else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"],
            },
        }  # fmt: skip


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}
