"""One sampling step of the model runner: edit the logits, choose, copy to the host once.

Per-request edits (logit_bias, min_tokens, grammar masks:
:mod:`pdserve.kernels.logits_processors`) run first, on the rows that asked for one; then a
plain greedy batch takes one argmax, any other the full sampler (:mod:`pdserve.kernels.sampling`)
over per-row parameter tensors. Either
way the results reach Python through one host copy (:mod:`pdserve.kernels.host_copy`): on CUDA
nothing in the step reads a device tensor before it, and waiting on it also means the forward
that wrote the step's K/V has run (the copy follows it on the stream).
"""

from __future__ import annotations

import torch

from pdserve.kernels.host_copy import HostSample, PendingHostSample
from pdserve.kernels.logits_processors import logits_processing_for
from pdserve.kernels.sampling import SamplerOutput, sample
from pdserve.kernels.sampling_tensors import is_plain_greedy, sampling_tensors_for
from pdserve.kernels.topk import argmax_rows
from pdserve.sequence import Sequence
from pdserve.types import TokenLogprob


def sample_step(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int], device: torch.device
) -> tuple[list[int], list[TokenLogprob | None] | None]:
    """One token per row of ``logits`` ``(B, vocab)`` float32 (``seqs[i]``'s parameters), and
    the logprobs aligned with ``seqs`` (None where a row did not ask; None when none did)."""
    processing = logits_processing_for(seqs, eos_token_ids, device)
    if processing is not None:  # logit_bias, min_tokens, grammar masks: before any choice
        with torch.inference_mode():  # the logits are inference tensors: edit them there
            logits = processing.apply(logits)
    if is_plain_greedy(seqs):
        # The common case needs no per-row parameters: skip building them.
        ids = argmax_rows(logits)
        return PendingHostSample(SamplerOutput(ids)).wait().token_ids, None
    tensors = sampling_tensors_for(seqs, device)
    with torch.inference_mode():
        host = PendingHostSample(sample(logits, tensors)).wait()
    if not tensors.need_logprobs:
        return host.token_ids, None
    return host.token_ids, _token_logprobs(host, seqs)


def _token_logprobs(host: HostSample, seqs: list[Sequence]) -> list[TokenLogprob | None]:
    assert host.logprobs is not None
    out: list[TokenLogprob | None] = []
    for i, s in enumerate(seqs):
        if not s.sampling.logprobs:
            out.append(None)
            continue
        n = s.sampling.top_logprobs
        top = ()
        if host.top_ids is not None and host.top_logprobs is not None:
            top = tuple(zip(host.top_ids[i][:n], host.top_logprobs[i][:n], strict=True))
        out.append(TokenLogprob(token_id=host.token_ids[i], logprob=host.logprobs[i], top=top))
    return out
