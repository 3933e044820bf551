"""Batched token sampling: penalties, temperature, top-k, top-p, seeded noise, logprobs.

Everything is vectorised over the batch; per-sequence parameters arrive as tensors built once
per step (:mod:`pdserve.kernels.sampling_tensors`). Randomness is counter-based: the noise for
vocab entry ``v`` of a sequence is a hash of ``(seed, position, v)``, so a seeded request draws
the same token whatever batch it runs in and without the sampler keeping any per-sequence state.
Sampling is an exponential race (equivalent to Gumbel-max): ``argmax(p_v / E_v)`` with
``E_v ~ Exp(1)`` picks ``v`` with probability ``p_v``.

Two formulations give the same tokens. On the CPU, reading a tensor costs nothing, so the step
takes data-dependent shortcuts (the candidate race of :mod:`~pdserve.kernels.sampling_candidates`
with a full-vocabulary fallback for the rows that need it, a bisection that stops once every row
converged). On a GPU each such read is a device->host sync that stalls the launch queue, so the
sync-free formulation runs a fixed amount of work: every row on the full-vocabulary path, the
top-p floor found by one sort of each row (a handful of kernels) instead of the CPU's bisection
(up to 31 rounds of masked sums, each several kernels). Which branches run is decided from
:class:`~pdserve.kernels.sampling_tensors.HostFlags`, known on the host before any kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.sampling_candidates import CANDIDATE_WIDTH, plan_candidates
from pdserve.kernels.sampling_tensors import SamplingTensors
from pdserve.kernels.topk import argmax_rows

_MASK32 = 0xFFFFFFFF
# Odd 32-bit constants of the murmur3 / lowbias32 finalisers.
_MIX_A = 0x7FEB352D
_MIX_B = 0x846CA68B
_GOLDEN = 0x9E3779B9
_SEED_MUL = 0x85EBCA6B
_MAX_UNIFORM = 1.0 - 2.0**-24  # the largest float32 below 1
# The top-p bisection's interval is at most 2**30 + 1 float32 bit patterns wide (probabilities
# lie in [0, 1], 1.0 is 0x3F800000): 31 halvings always reach adjacent patterns.
TOP_P_BISECTION_STEPS = 31


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # (B,) int64
    logprobs: torch.Tensor | None = None  # (B,) float32, of the chosen token
    top_ids: torch.Tensor | None = None  # (B, max_top_logprobs) int64
    top_logprobs: torch.Tensor | None = None  # (B, max_top_logprobs) float32


def _as_int32(value: int) -> int:
    # A 32-bit pattern as the signed int32 holding the same bits.
    return value - (1 << 32) if value >= 1 << 31 else value


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # lowbias32 finaliser on values kept in [0, 2**32): products wrap in int64 but their low
    # 32 bits are exact, and shifts act on non-negative values so they are logical.
    x = x ^ (x >> 16)
    x = (x * _MIX_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX_B) & _MASK32
    return x ^ (x >> 16)


def _mix32_int32(x: torch.Tensor) -> torch.Tensor:
    """:func:`_mix32` on int32 bit patterns (wrapping products, masked shifts): same bits.

    AVX2 has 32-bit but no 64-bit vector multiplies; this is ~5x faster on (B, vocab) noise.
    """
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _as_int32(_MIX_A)
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _as_int32(_MIX_B)
    return x ^ ((x >> 16) & 0xFFFF)


def uniform_noise(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_ids: torch.Tensor | int
) -> torch.Tensor:
    """Float32 uniforms in (0, 1), a pure function of (seed, position, vocab index).

    ``vocab_ids`` is a vocabulary size (noise for every id, ``(B, V)``) or a ``(B, N)`` tensor
    of ids (noise for those only; equal to the matching columns of the full noise).
    """
    seed_part = ((seeds & _MASK32) * _SEED_MUL) & _MASK32
    row = _mix32(seed_part ^ _mix32(positions & _MASK32))
    row = torch.where(row >= 1 << 31, row - (1 << 32), row).to(torch.int32).unsqueeze(1)
    if isinstance(vocab_ids, int):
        vocab_ids = torch.arange(vocab_ids, dtype=torch.int32, device=seeds.device).unsqueeze(0)
    bits = _mix32_int32(row ^ (vocab_ids.to(torch.int32) * _as_int32(_GOLDEN)))
    # 24 random bits centred in their bucket; the top bucket rounds to 1.0 in float32, so it
    # is clamped below 1 (-log(-log(1)) would be +inf and win any race, even a masked entry).
    u = (((bits >> 8) & 0xFFFFFF).float() + 0.5) * (1.0 / (1 << 24))
    return u.clamp_(max=_MAX_UNIFORM)


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Repetition (prompt + output, HF/CTRL style), frequency and presence (output only)."""
    if t.prompt_tokens is None or t.output_tokens is None:
        return logits
    num_seqs, vocab = logits.shape
    out_counts = _token_counts(t.output_tokens, num_seqs, vocab)
    seen = (_token_counts(t.prompt_tokens, num_seqs, vocab) + out_counts) > 0
    rep = t.repetition_penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - t.frequency_penalty.unsqueeze(1) * out_counts
    return logits - t.presence_penalty.unsqueeze(1) * (out_counts > 0).float()


def _token_counts(tokens: torch.Tensor, num_seqs: int, vocab: int) -> torch.Tensor:
    # One extra column swallows the -1 padding.
    counts = torch.zeros(num_seqs, vocab + 1, dtype=torch.float32, device=tokens.device)
    index = torch.where(tokens < 0, vocab, tokens)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab]


def _kth_largest(
    logits: torch.Tensor, k: torch.Tensor, is_active: torch.Tensor, k_max: int
) -> torch.Tensor:
    """Each row's k-th largest logit ``(B, 1)``; -inf for rows without top-k. ``k_max`` (from
    the host) is at least the largest active ``k``."""
    top = logits.topk(k_max, dim=1).values
    kth = top.gather(1, (k.clamp(max=k_max) - 1).unsqueeze(1))
    return kth.masked_fill(~is_active.unsqueeze(1), float("-inf"))


def _top_p_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row probability threshold ``(B, 1)`` of the top-p nucleus (0 for rows without).

    The nucleus is the smallest descending prefix whose mass reaches top_p; its last (floor)
    probability f is the smallest probability value whose strictly larger mass
    ``G(f) = sum(p > f)`` is below top_p. G only steps at probability values, so a bisection
    over float32 bit patterns (monotone for non-negative floats) lands exactly on f in at most
    31 masked sums (fewer for flat rows) instead of sorting the vocabulary (~3.5 ms per 32k row
    on this CPU). The sums are float64: float32 rounding (~1e-7) would decide borderline tokens.
    Stops once every row converged (a host read: the CPU formulation; see
    :func:`_top_p_floor_sorted` for the devices').
    """
    bits = probs.view(torch.int32)
    wide = probs.double()
    target = top_p.unsqueeze(1).double()
    lo = bits.amin(dim=1, keepdim=True) - 1  # G(below the min) = all mass: not < top_p
    hi = bits.amax(dim=1, keepdim=True)  # G(max) = 0 < top_p
    for _ in range(TOP_P_BISECTION_STEPS):
        if not bool((hi - lo > 1).any()):
            break
        mid = lo + (hi - lo) // 2
        is_inside = wide.masked_fill(bits <= mid, 0.0).sum(dim=1, keepdim=True) < target
        hi = torch.where(is_inside, mid, hi)
        lo = torch.where(is_inside, lo, mid)
    return hi.view(torch.float32).masked_fill(target >= 1.0, 0.0)


def _top_p_floor_sorted(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """:func:`_top_p_floor` by one sort per row, with no host read: the devices' formulation.

    With ``s`` a row sorted descending and ``E_i = s_0 + ... + s_(i-1)`` (float64), E is
    non-decreasing, so the indices with ``E_i < top_p`` are a prefix ``0 .. k-1`` and the floor
    is ``s_(k-1)``: ``G(s_(k-1)) <= E_(k-1) < top_p``, while any smaller value ``s_k`` has
    ``G(s_k) = E_k >= top_p`` (ties of ``s_(k-1)`` share its value). The same value the
    bisection lands on; the float64 sums run in another order, which could only matter for a
    top_p within ~1e-16 of a partial mass.
    """
    desc = probs.sort(dim=1, descending=True).values
    mass = desc.double().cumsum(dim=1)
    before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], dim=1)  # E_i  # (B, V)
    target = top_p.unsqueeze(1).double()
    k = (before < target).sum(dim=1, keepdim=True)  # >= 1 for top_p > 0 (E_0 = 0)
    floor = desc.gather(1, (k - 1).clamp(min=0))
    return floor.masked_fill(target >= 1.0, 0.0)


def _filter_top_k_top_p(
    logits: torch.Tensor, t: SamplingTensors, sync_free: bool = False
) -> torch.Tensor:
    """Mask (to -inf) entries outside each row's top-k, then outside its top-p nucleus.

    Entries tied with the last kept one are kept too.
    """
    vocab = logits.shape[1]
    flags = t.host_flags()
    truncating = [k for k in flags.top_ks if k < vocab]  # top_k >= vocab keeps every token
    if truncating:
        k = torch.where(t.top_k > 0, t.top_k.clamp(max=vocab), vocab)
        has_top_k = k < vocab
        kth = _kth_largest(logits, k, has_top_k, max(truncating))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if flags.any_top_p:
        probs = logits.softmax(dim=1)
        floor = (_top_p_floor_sorted if sync_free else _top_p_floor)(probs, t.top_p)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def _race(logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    # argmax p_v / E_v == argmax (logit_v - log E_v), E_v = -log u_v.
    return (logits - torch.log(-torch.log(noise))).argmax(dim=1)


def _full_vocab_sample(
    logits: torch.Tensor, t: SamplingTensors, sync_free: bool = False
) -> torch.Tensor:
    """The reference path: truncate over the whole vocabulary, race with noise for every id."""
    temperature = torch.where(t.temperature > 0, t.temperature, 1.0).unsqueeze(1)
    filtered = _filter_top_k_top_p(logits / temperature, t, sync_free)
    return _race(filtered, uniform_noise(t.seeds, t.positions, logits.shape[1]))


def apply_min_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Mask tokens whose probability (after temperature) is below ``min_p`` x the row's best.

    ``p_v >= min_p * p_max`` is ``logit_v >= logit_max + T * log(min_p)``: one row threshold,
    no softmax, no host read; ``min_p = 0`` gives a -inf threshold (nothing masked).
    """
    if t.min_p is None:
        return logits
    temperature = torch.where(t.temperature > 0, t.temperature, 1.0)
    floor = logits.amax(dim=1) + temperature * torch.log(t.min_p)
    return logits.masked_fill(logits < floor.unsqueeze(1), float("-inf"))


def _random_sample(
    logits: torch.Tensor, t: SamplingTensors, sync_free: bool = False
) -> torch.Tensor:
    """Sample each row; rows whose kept tokens provably lie in their top ``CANDIDATE_WIDTH``
    logits race over those only (see :mod:`pdserve.kernels.sampling_candidates`), the rest
    take the full-vocabulary path. Both give the same token; each row's work depends on that
    row alone, so a seeded row samples the same token in any batch. ``sync_free``: every row
    on the full-vocabulary path (picking the rows that need it would read the plan)."""
    vocab = logits.shape[1]
    if sync_free or vocab <= CANDIDATE_WIDTH:
        return _full_vocab_sample(logits, t, sync_free)
    plan = plan_candidates(logits, t.temperature, t.top_k, t.top_p)
    choice = _race(plan.scaled, uniform_noise(t.seeds, t.positions, plan.ids))
    token_ids = plan.ids.gather(1, choice.unsqueeze(1)).squeeze(1)
    missed = (~plan.is_exact).nonzero().squeeze(1)
    if missed.numel():
        token_ids[missed] = _full_vocab_sample(logits[missed], t.rows(missed))
    return token_ids


def sample(
    logits: torch.Tensor, t: SamplingTensors, sync_free: bool | None = None
) -> SamplerOutput:
    """Pick one token per row of float32 ``logits`` ``(B, V)``.

    Logprobs (when requested) are of the model's distribution after penalties, before
    temperature and truncation, as in the OpenAI API. ``sync_free`` (default: off the CPU)
    reads no tensor on the host (see the module docstring); the tokens are the same.
    """
    if sync_free is None:
        sync_free = logits.device.type != "cpu"
    flags = t.host_flags()
    logits = apply_penalties(logits, t)
    if flags.all_greedy:
        token_ids = argmax_rows(logits)
    elif flags.any_greedy:
        sampled = _random_sample(apply_min_p(logits, t), t, sync_free)
        token_ids = torch.where(t.temperature <= 0, argmax_rows(logits), sampled)
    else:
        token_ids = _random_sample(apply_min_p(logits, t), t, sync_free)
    out = SamplerOutput(token_ids=token_ids)
    if t.need_logprobs:
        logprobs = logits.log_softmax(dim=1)
        out.logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        if t.max_top_logprobs > 0:
            top = logprobs.topk(t.max_top_logprobs, dim=1)
            out.top_logprobs, out.top_ids = top.values, top.indices
    return out
