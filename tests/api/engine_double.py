"""Test doubles for the HTTP layer only: a byte-level tokenizer and an honest EngineClient.

FakeEngine replays the prompt's token ids as its output (cycling when asked for more), one
token per step, and honours max_tokens, eos / stop token ids and stop strings (with streaming
hold-back) like a real engine would. It can be told to fail with an EngineError (before the
first token or after k tokens) or to hang after k tokens until aborted, and it records every
request and abort it sees.
"""

from __future__ import annotations

import asyncio
import codecs
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.protocol import (
    EngineError,
    EngineInfo,
    GenerateOutput,
    GenerateRequest,
    TokenLogprob,
)

EOS_ID = 256
MODEL = "fake-model"


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255) plus an eos id (256)."""

    eos_token_ids = frozenset({EOS_ID})
    vocab_size = 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        if not skip_special_tokens and EOS_ID in ids:
            text += "</s>"
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        # Like many real templates: refuse to open an assistant turn after an assistant turn.
        if add_generation_prompt and messages and messages[-1]["role"] == "assistant":
            raise ValueError("the conversation must not end with an assistant message")
        # Extra variables (tools, chat_template_kwargs) show up as a header, sorted by name.
        head = "".join(f"[{k}={len(v) if k == 'tools' else v}]" for k, v in sorted(extra.items()))
        text = head + "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class LiveRequest:
    request: GenerateRequest
    abort_event: asyncio.Event = field(default_factory=asyncio.Event)
    num_generated: int = 0


def fake_logprob(token_id: int, top_k: int) -> TokenLogprob:
    """Deterministic logprobs so tests can check shapes and values."""
    logprob = -0.25 * (token_id % 7) - 0.1
    top = tuple(((token_id + k) % 256, logprob - k) for k in range(top_k))
    return TokenLogprob(token_id=token_id, logprob=logprob, top=top)


class FakeEngine:
    """EngineClient double; see the module docstring."""

    def __init__(self, max_model_len: int = 128) -> None:
        self.info = EngineInfo(
            role="colocated",
            model_name=MODEL,
            max_model_len=max_model_len,
            engine_id="engine-1",
            incarnation="inc-1",
        )
        self.tokenizer = ByteTokenizer()
        self.ready = True
        self.requests: list[GenerateRequest] = []
        self.aborts: list[tuple[str, str]] = []  # (request_id, reason) of successful aborts
        self.live: dict[str, LiveRequest] = {}
        self.fail_error: EngineError | None = None
        self.fail_after: int = 0  # tokens emitted before fail_error is raised
        self.fail_ids: set[str] | None = None  # only these requests fail (None: all)
        self.hang_after: int | None = None  # tokens emitted before waiting for abort/resume
        self.resume_event = asyncio.Event()  # set by resume(): hanging requests carry on

    def is_ready(self) -> bool:
        return self.ready

    def debug_requests(self) -> list[dict[str, Any]]:
        return [
            {"request_id": rid, "state": "running", "num_generated": live.num_generated}
            for rid, live in self.live.items()
        ]

    def debug_rooms(self) -> list[dict[str, Any]]:
        return [
            {"room_id": live.request.kv_transfer.room_id, "request_id": rid}
            for rid, live in self.live.items()
            if live.request.kv_transfer is not None
        ]

    async def abort(self, request_id: str, reason: str = "aborted") -> bool:
        live = self.live.get(request_id)
        if live is None or live.abort_event.is_set():
            return False
        self.aborts.append((request_id, reason))
        live.abort_event.set()
        return True

    def resume(self) -> None:
        self.resume_event.set()

    def aborted_ids(self) -> set[str]:
        return {rid for rid, _ in self.aborts}

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        self.requests.append(request)
        return self._generate(request)

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        live = LiveRequest(request)
        self.live[request.request_id] = live
        try:
            async for out in _Replay(self, live).run():
                yield out
        finally:
            del self.live[request.request_id]


class _Replay:
    """One request's generation loop (kept apart so FakeEngine stays readable)."""

    def __init__(self, engine: FakeEngine, live: LiveRequest) -> None:
        self.engine = engine
        self.live = live
        self.req = live.request
        self.sampling = live.request.sampling
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # decoded output so far
        self.num_sent = 0  # characters of self.text already emitted
        self.max_stop_len = max((len(s) for s in self.sampling.stop), default=0)

    def _out(self, ids: list[int], text: str, finish: str | None) -> GenerateOutput:
        logprobs = None
        if self.sampling.logprobs:
            logprobs = [fake_logprob(t, self.sampling.top_logprobs) for t in ids]
        return GenerateOutput(
            request_id=self.req.request_id,
            token_ids=ids,
            text=text,
            num_prompt_tokens=len(self.req.prompt_token_ids),
            num_generated_tokens=self.live.num_generated,
            finish_reason=finish,
            logprobs=logprobs,
        )

    def _should_fail(self, step: int) -> bool:
        engine = self.engine
        if engine.fail_error is None or step != engine.fail_after:
            return False
        return engine.fail_ids is None or self.req.request_id in engine.fail_ids

    async def run(self) -> AsyncIterator[GenerateOutput]:
        engine, prompt = self.engine, self.req.prompt_token_ids
        for step in range(self.sampling.max_tokens):
            if self._should_fail(step):
                assert engine.fail_error is not None
                raise engine.fail_error
            if engine.hang_after is not None and step == engine.hang_after:
                await self._wait_abort_or_resume()
            if self.live.abort_event.is_set():
                yield self._out([], "", "abort")
                return
            await asyncio.sleep(0)  # a real engine yields to the loop between steps
            token = prompt[step % len(prompt)]
            self.live.num_generated += 1
            out = self._step(token, is_last=step == self.sampling.max_tokens - 1)
            yield out
            if out.finish_reason is not None:
                return

    async def _wait_abort_or_resume(self) -> None:
        waiters = [
            asyncio.create_task(self.live.abort_event.wait()),
            asyncio.create_task(self.engine.resume_event.wait()),
        ]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    def _step(self, token: int, is_last: bool) -> GenerateOutput:
        if token in self.sampling.stop_token_ids or (
            token == EOS_ID and not self.sampling.ignore_eos
        ):
            return self._out([token], self._flush(len(self.text)), "stop")
        self.text += self.decoder.decode(bytes([token]) if token < 256 else b"")
        for stop in self.sampling.stop:
            pos = self.text.find(stop, max(0, self.num_sent - len(stop)))
            if pos != -1:
                return self._out([token], self._flush(pos), "stop")
        if is_last:
            return self._out([token], self._flush(len(self.text)), "length")
        # Hold back what could still turn out to be the start of a stop string.
        safe = len(self.text) - max(0, self.max_stop_len - 1)
        return self._out([token], self._flush(max(safe, self.num_sent)), None)

    def _flush(self, upto: int) -> str:
        piece = self.text[self.num_sent : upto]
        self.num_sent = max(self.num_sent, upto)
        return piece
