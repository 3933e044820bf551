"""OpenAI response objects built from engine deltas (plain dicts, encoded by the caller).

One builder per HTTP request. Streaming: :meth:`chunk` per delta. Non-streaming: :meth:`add` per
delta, then :meth:`response`. Both keep the per-choice counters that ``usage`` reports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from pdserve.api.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
)
from pdserve.api.prepare import PreparedRequest
from pdserve.engine.protocol import GenerateOutput


class ResponseBuilder(ABC):
    """What chat and text completions share: ids, counters, usage."""

    object_name = ""
    chunk_object = ""

    def __init__(self, prepared: PreparedRequest, texts: TokenTexts) -> None:
        self.prepared = prepared
        self.texts = texts
        n = prepared.num_choices
        self._num_generated = [0] * n
        self._num_cached = [0] * n  # prompt tokens each choice's engine found cached
        self._finish_reasons: list[str | None] = [None] * n
        self._texts: list[list[str]] = [[] for _ in range(n)]

    def _header(self, object_name: str) -> dict[str, Any]:
        p = self.prepared
        return {"id": p.request_id, "object": object_name, "created": p.created, "model": p.model}

    def _record(self, index: int, out: GenerateOutput) -> None:
        self._num_generated[index] = out.num_generated_tokens
        self._num_cached[index] = max(self._num_cached[index], out.num_cached_tokens)
        if out.finish_reason is not None:
            self._finish_reasons[index] = out.finish_reason

    def usage(self) -> dict[str, Any]:
        # n samples of one prompt read it once, as OpenAI counts it (choices are prompt-major).
        prompt_tokens = sum(self.prepared.prompt_lens)
        completion_tokens = sum(self._num_generated)
        n = self.prepared.options.n
        cached = [self._num_cached[i : i + n] for i in range(0, len(self._num_cached), n)]
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(max(c) for c in cached)},
        }

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def usage_chunk(self) -> dict[str, Any]:
        """Last chunk when ``stream_options.include_usage``: no choices, the totals."""
        return {**self._header(self.chunk_object), "choices": [], "usage": self.usage()}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._header(self.chunk_object), "choices": [choice]}
        if self.prepared.options.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk

    def add(self, index: int, out: GenerateOutput) -> None:
        """Accumulate a delta for the non-streaming response."""
        self._record(index, out)
        if out.text:
            self._texts[index].append(out.text)
        self._add_logprobs(index, out)

    @abstractmethod
    def chunk(self, index: int, out: GenerateOutput) -> dict[str, Any] | None:
        """The stream chunk for one delta, or None when it carries nothing a client would see."""

    @abstractmethod
    def response(self) -> dict[str, Any]:
        """The non-streaming response object from everything :meth:`add` received."""

    @abstractmethod
    def _add_logprobs(self, index: int, out: GenerateOutput) -> None: ...


class ChatResponseBuilder(ResponseBuilder):
    """``chat.completion`` and ``chat.completion.chunk`` objects."""

    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, prepared: PreparedRequest, texts: TokenTexts) -> None:
        super().__init__(prepared, texts)
        self._logprobs: list[list[dict[str, Any]]] = [[] for _ in range(prepared.num_choices)]

    def opening_chunks(self) -> list[dict[str, Any]]:
        """OpenAI opens each choice with an empty assistant delta carrying the role."""
        return [
            self._chunk(_chat_choice(i, {"role": "assistant", "content": ""}, None, None))
            for i in range(self.prepared.num_choices)
        ]

    def chunk(self, index: int, out: GenerateOutput) -> dict[str, Any] | None:
        """The chunk for one delta, or None when it carries nothing a client would see."""
        self._record(index, out)
        logprobs = self._logprob_block(out)
        if not out.text and out.finish_reason is None and logprobs is None:
            return None
        delta = {"content": out.text} if out.text else {}
        return self._chunk(_chat_choice(index, delta, logprobs, out.finish_reason))

    def _logprob_block(self, out: GenerateOutput) -> dict[str, Any] | None:
        if not self.prepared.options.logprobs or not out.logprobs:
            return None
        return {"content": chat_logprobs(out.logprobs, self.texts)}

    def _add_logprobs(self, index: int, out: GenerateOutput) -> None:
        if self.prepared.options.logprobs and out.logprobs:
            self._logprobs[index].extend(chat_logprobs(out.logprobs, self.texts))

    def response(self) -> dict[str, Any]:
        choices = []
        for i in range(self.prepared.num_choices):
            logprobs = {"content": self._logprobs[i]} if self.prepared.options.logprobs else None
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": "".join(self._texts[i])},
                    "logprobs": logprobs,
                    "finish_reason": self._finish_reasons[i],
                }
            )
        return {**self._header(self.object_name), "choices": choices, "usage": self.usage()}


def _chat_choice(
    index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish: str | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


class CompletionResponseBuilder(ResponseBuilder):
    """``text_completion`` objects (the same object name streamed and not, as OpenAI does)."""

    object_name = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, prepared: PreparedRequest, texts: TokenTexts) -> None:
        super().__init__(prepared, texts)
        n = prepared.num_choices
        self._text_offsets = [0] * n  # legacy text_offset continues across chunks
        self._blocks: list[list[dict[str, Any]]] = [[] for _ in range(n)]

    def chunk(self, index: int, out: GenerateOutput) -> dict[str, Any] | None:
        """The chunk for one delta, or None when it carries nothing a client would see."""
        self._record(index, out)
        logprobs = self._logprob_block(index, out)
        if not out.text and out.finish_reason is None and logprobs is None:
            return None
        return self._chunk(
            {
                "index": index,
                "text": out.text,
                "logprobs": logprobs,
                "finish_reason": out.finish_reason,
            }
        )

    def _logprob_block(self, index: int, out: GenerateOutput) -> dict[str, Any] | None:
        if not self.prepared.options.logprobs or not out.logprobs:
            return None
        block, self._text_offsets[index] = completion_logprobs(
            out.logprobs, self.texts, self._text_offsets[index]
        )
        return block

    def _add_logprobs(self, index: int, out: GenerateOutput) -> None:
        block = self._logprob_block(index, out)
        if block is not None:
            self._blocks[index].append(block)

    def response(self) -> dict[str, Any]:
        choices = []
        for i in range(self.prepared.num_choices):
            logprobs = None
            if self.prepared.options.logprobs:
                logprobs = merge_completion_logprobs(self._blocks[i])
            choices.append(
                {
                    "index": i,
                    "text": "".join(self._texts[i]),
                    "logprobs": logprobs,
                    "finish_reason": self._finish_reasons[i],
                }
            )
        return {**self._header(self.object_name), "choices": choices, "usage": self.usage()}
