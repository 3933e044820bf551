"""What a model runner step returns (:class:`RunnerOutput`) and the counters it keeps
(:class:`RunnerStats`), apart from the runner so the engine's step code names them alone."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.kernels.kv_ready import ALWAYS_READY, KVReady
from pdserve.kernels.prompt_logprobs import PromptLogprobs
from pdserve.types import TokenLogprob


@dataclass
class RunnerOutput:
    """One sampled token per input sequence, in input order.

    ``logprobs`` is None when no sequence asked for logprobs; otherwise it is aligned with the
    input and holds None for the sequences that did not ask. ``kv_ready`` completes once the
    forward's KV writes are done on the device: what a KV transfer of these pages, or a reuse
    of pages freed during the step, waits for (see pdserve.kernels.kv_ready).
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None
    kv_ready: KVReady = ALWAYS_READY
    prompt_logprobs: list[PromptLogprobs | None] | None = None  # prefill, when some asked


@dataclass
class RunnerStats:
    """Plain counters for the metrics module to read at scrape time."""

    num_prefill_calls: int = 0
    num_prefill_tokens: int = 0
    num_decode_steps: int = 0
    num_decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    # The last call's split: prepare_s (batch tensors), forward_s (model), sample_s (sampling
    # and conversion to Python lists).
    last_step: dict[str, float] = field(default_factory=dict)

    def record(self, t0: float, t1: float, t2: float) -> float:
        """Keep the last call's split (batch building / model forward / sampling), ended
        now; the call's total seconds."""
        t3 = time.perf_counter()
        self.last_step = {"prepare_s": t1 - t0, "forward_s": t2 - t1, "sample_s": t3 - t2}
        return t3 - t0
