"""A request as the engine admits it: its seed fixed, its size checked against the KV pool, its
sequence and output state built. Pure construction; the engine then registers it and arms its
deadlines."""

from __future__ import annotations

import random

from pdserve.engine.output import OutputState
from pdserve.engine.prefill_rate import PrefillRate
from pdserve.engine.protocol import EngineError, GenerateRequest, ResumeState
from pdserve.engine.request import Request
from pdserve.kernels.kv_cache import KVCacheConfig
from pdserve.model.tokenizer import Tokenizer
from pdserve.reasoning.gate import ThinkingState, grammar_sees
from pdserve.sequence import Sequence


def new_request(
    request: GenerateRequest,
    kv: KVCacheConfig,
    num_pages: int,
    max_model_len: int,
    tokenizer: Tokenizer,
) -> Request:
    """The engine's :class:`Request` for ``request``. A sampler with no seed gets one now, so
    that a migrated stream can continue exactly; a request that could never fit in the pool's
    ``num_pages`` is a 400 (``context_length_exceeded``)."""
    sp = request.sampling
    if sp.seed is None:
        sp.seed = random.getrandbits(62)
    num_prompt = len(request.prompt_token_ids)
    need = kv.pages_for(min(num_prompt + sp.max_tokens, max_model_len))
    if need > num_pages:
        raise EngineError(
            f"request needs {need} KV pages, the cache holds {num_pages}",
            400, "invalid_request_error", "context_length_exceeded",
        )  # fmt: skip
    seq = Sequence(request.request_id, list(request.prompt_token_ids), num_prompt, sp)
    seq.grammar = request.grammar
    if request.reasoning is not None:
        ThinkingState.attach(seq, request.reasoning)  # the grammar sleeps while it thinks
    req = Request(
        request.request_id, seq, request.kv_transfer, request.priority, resume=request.resume
    )
    req.out_state = OutputState(req.request_id, seq, tokenizer, max_model_len)
    if request.resume is not None:
        _resume(req, request.resume)
    return req


def _resume(req: Request, resume: ResumeState) -> None:
    """A migrated stream continues after the tokens another worker streamed: they join the
    sequence as generated tokens (penalties, ``min_tokens``, ``max_tokens`` and the seeded
    noise's position count them), its grammar and its output state move past them (their text
    is not sent again), and one prefill computes the KV of prompt and tokens together: by
    batch invariance the same bits the other worker's decode steps wrote, so the continuation
    is the one that worker would have streamed."""
    seq = req.seq
    for token in resume.token_ids:
        seq.token_ids.append(token)
        is_fed = grammar_sees(seq, token)
        if is_fed and seq.grammar is not None and not seq.grammar.accept(token):
            raise EngineError(
                f"resume_params.token_ids: token {token} does not fit the response format",
                400, "invalid_request_error", "resume_params",
            )  # fmt: skip
        req.out_state.replay(token, resume)


def check_prefill_time(num_prompt_tokens: int, deadline_s: float, rate: PrefillRate) -> None:
    """Refuse a prompt this engine cannot prefill within the request's deadline at its measured
    prefill rate (a 400 with the estimate), rather than computing it until the deadline fires.
    Nothing is refused before a prefill step was measured."""
    estimate = rate.estimate_s(num_prompt_tokens)
    if estimate is None or estimate <= deadline_s:
        return
    raise EngineError(
        f"the prompt's {num_prompt_tokens} tokens need about {estimate:.1f} s to prefill here "
        f"(measured {rate.tokens_per_s:.1f} tokens/s), more than the request's deadline of "
        f"{deadline_s:g} s",
        400, "invalid_request_error", "prefill_exceeds_deadline",
    )  # fmt: skip
