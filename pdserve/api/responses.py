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
from pdserve.api.tools import ToolCall, ToolConfig, may_start_call, parse_tool_calls
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

    def _is_empty(self, out: GenerateOutput, text: str, logprobs: dict[str, Any] | None) -> bool:
        # With return_token_ids a delta whose text is held back still names its tokens.
        if self.prepared.options.return_token_ids and out.token_ids:
            return False
        return not text and out.finish_reason is None and logprobs is None

    def _tagged(self, chunk: dict[str, Any], out: GenerateOutput) -> dict[str, Any]:
        """The chunk, plus its token ids when the router asked (``return_token_ids``)."""
        if self.prepared.options.return_token_ids:
            chunk["choices"][0]["token_ids"] = list(out.token_ids)
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

    def __init__(
        self, prepared: PreparedRequest, texts: TokenTexts, tools: ToolConfig | None = None
    ) -> None:
        super().__init__(prepared, texts)
        n = prepared.num_choices
        self._logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        # Tool calls are parsed from the text: streamed text is held from where one may start.
        self._tools = tools if tools is not None and tools.mode != "none" else None
        self._num_streamed = [0] * n  # characters of the choice's text already sent
        # Named tool_choice: one call per choice, its id fixed when its first delta is sent.
        self._named_call: list[ToolCall | None] = [
            ToolCall(tools.named, "") if tools is not None and tools.named else None
            for _ in range(n)
        ]

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
        if self._tools is not None:
            return self._tool_chunk(index, out, logprobs)
        if self._is_empty(out, out.text, logprobs):
            return None
        delta = {"content": out.text} if out.text else {}
        return self._tagged(
            self._chunk(_chat_choice(index, delta, logprobs, out.finish_reason)), out
        )

    def _tool_chunk(
        self, index: int, out: GenerateOutput, logprobs: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        assert self._tools is not None
        if out.text:
            self._texts[index].append(out.text)
        text = "".join(self._texts[index])
        finish = out.finish_reason
        delta: dict[str, Any] = {}
        named = self._named_call[index]
        if named is not None:  # the text is the arguments: stream it as they arrive
            if out.text or finish is not None:
                sent = self._num_streamed[index]
                call: dict[str, Any] = {"index": 0, "function": {"arguments": text[sent:]}}
                if sent == 0:
                    call = ToolCall(named.name, text, named.id).to_dict(0)
                self._num_streamed[index] = len(text)
                delta["tool_calls"] = [call]
            finish = "tool_calls" if finish == "stop" else finish
        elif finish is None:
            hold = may_start_call(text, self._tools)
            if hold > self._num_streamed[index]:
                delta["content"] = text[self._num_streamed[index] : hold]
                self._num_streamed[index] = hold
        else:
            content, calls = parse_tool_calls(text, self._tools)
            shown = (content or "") if calls else text
            rest = shown[self._num_streamed[index] :]
            if rest:
                delta["content"] = rest
            if calls:
                delta["tool_calls"] = [c.to_dict(i) for i, c in enumerate(calls)]
                finish = "tool_calls" if finish == "stop" else finish
        if not delta and finish is None and logprobs is None:
            return None
        return self._chunk(_chat_choice(index, delta, logprobs, finish))

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
            message, finish = self._message(i)
            choices.append(
                {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}
            )
        return {**self._header(self.object_name), "choices": choices, "usage": self.usage()}

    def _message(self, index: int) -> tuple[dict[str, Any], str | None]:
        text, finish = "".join(self._texts[index]), self._finish_reasons[index]
        if self._tools is None:
            return {"role": "assistant", "content": text}, finish
        content, calls = parse_tool_calls(text, self._tools)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        message = {
            "role": "assistant",
            "content": content,
            "tool_calls": [c.to_dict() for c in calls],
        }
        return message, "tool_calls" if finish == "stop" else finish


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
        self._echoed = [False] * n

    def chunk(self, index: int, out: GenerateOutput) -> dict[str, Any] | None:
        """The chunk for one delta, or None when it carries nothing a client would see."""
        self._record(index, out)
        logprobs = self._logprob_block(index, out)
        text = self._echo_once(index) + out.text
        if self._is_empty(out, text, logprobs):
            return None
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
        }
        return self._tagged(self._chunk(choice), out)

    def _echo_once(self, index: int) -> str:
        # The prompt text goes before the choice's first delta, once.
        if self._echoed[index]:
            return ""
        self._echoed[index] = True
        return self.prepared.echo_text(index)

    def add(self, index: int, out: GenerateOutput) -> None:
        echo = self._echo_once(index)
        if echo:
            self._texts[index].append(echo)
        super().add(index, out)

    def _logprob_block(self, index: int, out: GenerateOutput) -> dict[str, Any] | None:
        if not self.prepared.options.logprobs or not (out.logprobs or out.prompt_logprobs):
            return None
        blocks = []
        if out.prompt_logprobs:  # echo: the prompt's tokens come first, as their text does
            prompt_ids = self.prepared.engine_requests[index].prompt_token_ids
            block, self._text_offsets[index] = completion_logprobs(
                out.prompt_logprobs, self.texts, self._text_offsets[index], prompt_ids
            )
            blocks.append(block)
        if out.logprobs:
            block, self._text_offsets[index] = completion_logprobs(
                out.logprobs, self.texts, self._text_offsets[index]
            )
            blocks.append(block)
        return blocks[0] if len(blocks) == 1 else merge_completion_logprobs(blocks)

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
