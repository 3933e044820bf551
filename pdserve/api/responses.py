"""OpenAI response objects built from engine deltas (plain dicts, encoded by the caller).

One builder per HTTP request: :meth:`chunk` per streamed delta, or :meth:`add` per delta then
:meth:`response`; either way it keeps the per-choice counters that ``usage`` reports.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any

from pdserve.api.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
    vllm_prompt_logprobs,
)
from pdserve.api.prepare import PreparedRequest
from pdserve.api.reasoning import ChoiceReasoning
from pdserve.api.tool_parsers import DEFAULT_PARSER, ParseDelta, make_parser, parse_whole
from pdserve.api.tools import ToolConfig
from pdserve.engine.protocol import GenerateOutput, TokenLogprob


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
        self._token_ids: list[list[int]] = [[] for _ in range(n)]  # return_token_ids
        self._prompt_logprobs: list[list[Any] | None] = [None] * n  # vLLM's prompt_logprobs
        self._is_opened = [False] * n  # the choice's first chunk went out

    def _visible(self, out: GenerateOutput) -> GenerateOutput:
        """The delta as the client sees it: prompt scoring (``max_tokens: 0``) leaves out the
        one token the engine sampled alongside the prompt's logits."""
        if not self.prepared.options.is_scoring_only:
            return out
        return dataclasses.replace(
            out,
            token_ids=[],
            text="",
            logprobs=None,
            num_generated_tokens=0,
            finish_reason="length" if out.finish_reason is not None else None,
            stop_reason=None,
        )

    def _header(self, object_name: str) -> dict[str, Any]:
        p = self.prepared
        return {"id": p.request_id, "object": object_name, "created": p.created, "model": p.model}

    def _record(self, index: int, out: GenerateOutput) -> None:
        options = self.prepared.options
        if options.return_token_ids:
            self._token_ids[index].extend(out.token_ids)
        if options.prompt_logprobs is not None and out.prompt_logprobs:
            self._prompt_logprobs[index] = vllm_prompt_logprobs(
                out.prompt_logprobs, self.texts, options.return_tokens_as_token_ids
            )
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

    def closing_chunks(self) -> list[dict[str, Any]]:
        """What a stream sends after its last delta (before ``[DONE]``)."""
        return [self.usage_chunk()] if self.prepared.options.include_usage else []

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._header(self.chunk_object), "choices": [choice]}
        options = self.prepared.options
        if options.continuous_usage:  # vLLM: the totals so far on every chunk
            chunk["usage"] = self.usage()
        elif options.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk

    def _is_empty(self, out: GenerateOutput, text: str, logprobs: dict[str, Any] | None) -> bool:
        # With return_token_ids a delta whose text is held back still names its tokens.
        if self.prepared.options.return_token_ids and out.token_ids:
            return False
        if self.prepared.options.prompt_logprobs is not None and out.prompt_logprobs:
            return False
        return not text and out.finish_reason is None and logprobs is None

    def _tagged(self, chunk: dict[str, Any], index: int, out: GenerateOutput) -> dict[str, Any]:
        """The chunk plus vLLM's extras: its token ids (``return_token_ids``; the router asks
        too), and on the choice's first chunk the prompt's ids and ``prompt_logprobs``."""
        options, choice = self.prepared.options, chunk["choices"][0]
        is_first = not self._is_opened[index]
        self._is_opened[index] = True
        if options.return_token_ids:
            choice["token_ids"] = list(out.token_ids)
            if is_first:  # vLLM: on the chat chunk, on each completion choice
                target = choice if self.object_name == "text_completion" else chunk
                target["prompt_token_ids"] = self._prompt_ids(index)
        if self._prompt_logprobs[index] is not None and out.prompt_logprobs:
            choice["prompt_logprobs"] = self._prompt_logprobs[index]
        return chunk

    def _prompt_ids(self, index: int) -> list[int]:
        return list(self.prepared.engine_requests[index].prompt_token_ids)

    def _extras(self, index: int, choice: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed choice plus its token ids and prompt logprobs, when asked."""
        if self.prepared.options.return_token_ids:
            choice["prompt_token_ids"] = self._prompt_ids(index)
            choice["token_ids"] = self._token_ids[index]
        if self.prepared.options.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs[index]
        return choice

    def add(self, index: int, out: GenerateOutput) -> None:
        """Accumulate a delta for the non-streaming response."""
        out = self._visible(out)
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
        self,
        prepared: PreparedRequest,
        texts: TokenTexts,
        tools: ToolConfig | None = None,
        reasoning: ChoiceReasoning | None = None,
        tool_parser: str = DEFAULT_PARSER,
    ) -> None:
        super().__init__(prepared, texts)
        self._reasoning, n = reasoning, prepared.num_choices  # reasoning: --reasoning-parser
        self._logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        # Tool calls are parsed from the text, by one streaming parser per choice.
        self._tools = tools if tools is not None and tools.mode != "none" else None
        self._tool_parser = tool_parser
        tools = self._tools
        self._parsers = [make_parser(tools, tool_parser) for _ in range(n)] if tools else []

    def opening_chunks(self) -> list[dict[str, Any]]:
        """OpenAI opens each choice with an empty assistant delta carrying the role; with
        tools its content is null, so an answer of calls alone assembles to ``content: null``
        as the unstreamed message has it."""
        content = None if self._tools is not None else ""
        return [
            self._chunk(_chat_choice(i, {"role": "assistant", "content": content}, None, None))
            for i in range(self.prepared.num_choices)
        ]

    def chunk(self, index: int, out: GenerateOutput) -> dict[str, Any] | None:
        """The chunk for one delta, or None when it carries nothing a client would see."""
        if self._reasoning is not None:  # the thinking block first, then content and tools
            return self._reasoning.chunk(index, out, self._content_chunk, self._chunk)
        return self._content_chunk(index, out)

    def _content_chunk(self, index: int, out: GenerateOutput) -> dict[str, Any] | None:
        self._record(index, out)
        logprobs = self._logprob_block(out)
        if self._tools is not None:
            return self._tool_chunk(index, out, logprobs)
        if self._is_empty(out, out.text, logprobs):
            return None
        delta = {"content": out.text} if out.text else {}
        chunk = self._chunk(_chat_choice(index, delta, logprobs, out.finish_reason))
        return self._tagged(chunk, index, out)

    def _tool_chunk(
        self, index: int, out: GenerateOutput, logprobs: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        # The seam: text deltas in, (content, tool-call deltas) out.
        parser = self._parsers[index]
        parsed = parser.feed(out.text) if out.text else ParseDelta()
        finish = out.finish_reason
        if finish is not None:
            parsed = parsed.extend(parser.finish())
            if parser.num_calls and finish == "stop":
                finish = "tool_calls"
        delta: dict[str, Any] = {}
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.calls:
            delta["tool_calls"] = [c.to_dict() for c in parsed.calls]
        if not delta and finish is None and logprobs is None:
            return None
        return self._chunk(_chat_choice(index, delta, logprobs, finish))

    def _logprob_block(self, out: GenerateOutput) -> dict[str, Any] | None:
        options = self.prepared.options
        if not options.logprobs or not out.logprobs:
            return None
        as_ids = options.return_tokens_as_token_ids
        return {"content": chat_logprobs(out.logprobs, self.texts, as_ids)}

    def _add_logprobs(self, index: int, out: GenerateOutput) -> None:
        options = self.prepared.options
        if options.logprobs and out.logprobs:
            as_ids = options.return_tokens_as_token_ids
            self._logprobs[index].extend(chat_logprobs(out.logprobs, self.texts, as_ids))

    def response(self) -> dict[str, Any]:
        choices = []
        for i in range(self.prepared.num_choices):
            logprobs = {"content": self._logprobs[i]} if self.prepared.options.logprobs else None
            message, finish = self._message(i)
            choice = {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}
            if self.prepared.options.return_token_ids:
                choice["token_ids"] = self._token_ids[i]
            choices.append(choice)
        response = {**self._header(self.object_name), "choices": choices, "usage": self.usage()}
        # vLLM puts the (one) conversation's prompt extras on the response itself.
        if self.prepared.options.return_token_ids:
            response["prompt_token_ids"] = self._prompt_ids(0)
        if self.prepared.options.prompt_logprobs is not None:
            response["prompt_logprobs"] = self._prompt_logprobs[0]
        return response

    def _message(self, index: int) -> tuple[dict[str, Any], str | None]:
        text = "".join(self._texts[index])
        if self._reasoning is not None:
            return self._reasoning.message(index, text, self._content_message)
        return self._content_message(index, text)

    def _content_message(self, index: int, text: str) -> tuple[dict[str, Any], str | None]:
        finish = self._finish_reasons[index]
        if self._tools is None:
            return {"role": "assistant", "content": text}, finish
        content, calls = parse_whole(make_parser(self._tools, self._tool_parser), text)
        if not calls:
            return {"role": "assistant", "content": content}, finish
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
        out = self._visible(out)
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
        return self._tagged(self._chunk(choice), index, out)

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
        options = self.prepared.options
        is_echoed = options.echo and bool(out.prompt_logprobs)
        if not options.logprobs or not (out.logprobs or is_echoed):
            return None
        as_ids = options.return_tokens_as_token_ids
        blocks = []
        if is_echoed:  # the prompt's tokens come first, as their text does
            assert out.prompt_logprobs is not None
            block, self._text_offsets[index] = completion_logprobs(
                _top_n(out.prompt_logprobs, options.top_logprobs),
                self.texts,
                self._text_offsets[index],
                self._prompt_ids(index),
                as_ids,
            )
            blocks.append(block)
        if out.logprobs:
            block, self._text_offsets[index] = completion_logprobs(
                out.logprobs, self.texts, self._text_offsets[index], None, as_ids
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
            choice = {
                "index": i,
                "text": "".join(self._texts[i]),
                "logprobs": logprobs,
                "finish_reason": self._finish_reasons[i],
            }
            choices.append(self._extras(i, choice))
        return {**self._header(self.object_name), "choices": choices, "usage": self.usage()}


def _top_n(entries: list[TokenLogprob | None], n: int) -> list[TokenLogprob | None]:
    # The prompt's entries carry as many alternatives as the larger of echo's logprobs and
    # prompt_logprobs asked for; the legacy block shows logprobs' count.
    return [
        e if e is None or len(e.top) <= n else dataclasses.replace(e, top=e.top[:n])
        for e in entries
    ]
