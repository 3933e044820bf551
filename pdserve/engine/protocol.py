"""What the HTTP layer and the Python embedding see of an engine (any role).

The HTTP handlers validate and tokenize, then call :meth:`EngineClient.generate`; the engine
streams :class:`GenerateOutput` deltas. Errors that end a request after admission are raised
as :class:`EngineError` carrying the HTTP status and OpenAI error type to report.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.reasoning.gate import ReasoningSpec
from pdserve.sampling_params import SamplingParams
from pdserve.types import TokenLogprob as TokenLogprob  # part of what the engine streams

if TYPE_CHECKING:
    from pdserve.grammar.matcher import GrammarMatcher


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """PD hand-off coordinates, chosen by the router and given to both legs of a request."""

    room_id: str
    bootstrap_host: str
    bootstrap_port: int


@dataclass(frozen=True, slots=True)
class ResumeState:
    """A request migrated mid-stream (the router's ``resume_params``): the tokens another
    worker already generated and streamed, and how many characters of text the client got.

    The tokens go after the prompt as *generated* tokens (penalties, ``min_tokens``, the
    seeded-noise position and ``max_tokens`` all count them), and their text is not sent again.
    """

    token_ids: tuple[int, ...]
    num_text_chars: int


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    kv_transfer: KVTransferParams | None = None
    deadline_s: float | None = None  # overall request deadline, relative to admission
    grammar: GrammarMatcher | None = None  # structured output: this stream's own matcher
    resume: ResumeState | None = None  # migrated: continue after these generated tokens
    reasoning: ReasoningSpec | None = None  # a thinking block: the grammar starts after it
    priority: int = 0  # --scheduling-policy priority: lower values first (vLLM's meaning)


@dataclass(slots=True)
class GenerateOutput:
    """One streamed delta. The last one has ``finish_reason`` set."""

    request_id: str
    token_ids: list[int]  # tokens new in this delta
    text: str  # text new in this delta (stop strings held back and trimmed)
    num_prompt_tokens: int
    num_generated_tokens: int  # total so far
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # The first delta only, when asked: one entry per prompt token (the first is None).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EngineError(Exception):
    """A request that ended in error after admission (timeout, lost peer, transfer failure)."""

    message: str
    status: int = 503
    err_type: str = "service_unavailable"
    code: str | None = None

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True, slots=True)
class EngineInfo:
    role: str  # "prefill" | "decode" | "colocated"
    model_name: str
    max_model_len: int
    engine_id: str
    incarnation: str
    bootstrap_port: int | None = None  # prefill only
    extra: dict[str, Any] = field(default_factory=dict)
    dtype: str = ""  # KV dtype, e.g. "bfloat16" (routers pair only equal ones)
    kv_layout: str = ""  # transport.layout.layout_fingerprint of the page pool
    weights: str = ""  # model.fingerprint.weights_fingerprint (prefill and decode roles)


class TokenizerLike(Protocol):
    eos_token_ids: frozenset[int]
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str: ...


class EngineClient(Protocol):
    info: EngineInfo
    tokenizer: TokenizerLike

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]: ...

    async def abort(self, request_id: str, reason: str = "aborted") -> bool: ...

    def is_ready(self) -> bool: ...

    def load(self) -> dict[str, int]: ...

    def debug_requests(self) -> list[dict[str, Any]]: ...

    def debug_rooms(self) -> list[dict[str, Any]]: ...
