"""A batch's per-row sampling parameters as device tensors, built once per step.

The values are gathered on the host into one int64 and one float32 list and reach the device in
one copy (pinned, asynchronous on CUDA). :class:`HostFlags` records what the host knows about
them, so the sampler branches without reading a device tensor back.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from pdserve.sequence import Sequence

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class HostFlags:
    """What the host knows about a batch's parameters before any kernel runs. The step
    branches on these instead of reducing a device tensor (a sync on CUDA). They may be
    conservative (a branch taken that changes nothing), never wrong the other way."""

    all_greedy: bool
    any_greedy: bool
    top_ks: frozenset[int]  # the top_k values (> 0) of the rows using one
    any_top_p: bool


@dataclass
class SamplingTensors:
    """Per-row sampling parameters for one batch, shape ``(B,)`` unless noted."""

    temperature: torch.Tensor  # float32; <= 0 means greedy
    top_k: torch.Tensor  # int64; <= 0 disables
    top_p: torch.Tensor  # float32; 1.0 disables
    seeds: torch.Tensor  # int64, 0 .. 2**32-1
    positions: torch.Tensor  # int64, index of the token being sampled
    repetition_penalty: torch.Tensor  # float32; 1.0 disables
    frequency_penalty: torch.Tensor  # float32
    presence_penalty: torch.Tensor  # float32
    # Padded token histories (pad = -1), only when some row uses a penalty.
    prompt_tokens: torch.Tensor | None = None  # (B, max_prompt)
    output_tokens: torch.Tensor | None = None  # (B, max_output)
    max_top_logprobs: int = 0
    need_logprobs: bool = False
    host: HostFlags | None = None  # None: derived from the tensors (reads them)
    min_p: torch.Tensor | None = None  # float32 (B,), only when some row uses min_p

    def rows(self, index: torch.Tensor) -> SamplingTensors:
        """The truncation/noise parameters of the rows in ``index`` (no penalties/logprobs)."""
        return SamplingTensors(
            temperature=self.temperature[index],
            top_k=self.top_k[index],
            top_p=self.top_p[index],
            seeds=self.seeds[index],
            positions=self.positions[index],
            repetition_penalty=self.repetition_penalty[index],
            frequency_penalty=self.frequency_penalty[index],
            presence_penalty=self.presence_penalty[index],
            host=self.host,  # a superset's flags stay valid for a subset
            min_p=None if self.min_p is None else self.min_p[index],
        )

    def host_flags(self) -> HostFlags:
        """:attr:`host`, or the flags read from the tensors when none were given."""
        if self.host is not None:
            return self.host
        is_greedy = self.temperature <= 0
        uses_k = self.top_k > 0
        return HostFlags(
            all_greedy=bool(is_greedy.all()),
            any_greedy=bool(is_greedy.any()),
            top_ks=frozenset(self.top_k[uses_k].tolist()),
            any_top_p=bool((self.top_p < 1.0).any()),
        )


def is_plain_greedy(seqs: list[Sequence]) -> bool:
    """True when every row is greedy with no penalty and no logprobs: the sampled token is the
    argmax of the raw logits, and no sampling tensors are needed at all."""
    return all(
        s.sampling.is_greedy
        and not s.sampling.logprobs
        and s.sampling.repetition_penalty == 1.0
        and not s.sampling.frequency_penalty
        and not s.sampling.presence_penalty
        for s in seqs
    )


def _fold_seed(seed: int) -> int:
    # Any Python int (negative, > 32 bits) to the 32 bits the hash uses.
    seed &= 0xFFFFFFFFFFFFFFFF
    return (seed ^ (seed >> 32)) & _MASK32


def _padded(rows: list[list[int]]) -> list[int]:
    width = max(map(len, rows), default=0)
    return [x for r in rows for x in (*r, *[-1] * (width - len(r)))]


def _to_device(
    ints: torch.Tensor, floats: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both host tensors on ``device`` through ONE copy: the float32 values ride as bit
    patterns at the end of one int64 (pinned) buffer, viewed back on the device."""
    if device.type == "cpu":
        return ints, floats
    num_ints, num_floats = ints.numel(), floats.numel()
    host = torch.empty(num_ints + -(-num_floats // 2), dtype=torch.int64, pin_memory=True)
    host[:num_ints] = ints
    host[num_ints:].view(torch.float32)[:num_floats] = floats
    buf = host.to(device, non_blocking=True)
    return buf[:num_ints], buf[num_ints:].view(torch.float32)[:num_floats]


def sampling_tensors_for(seqs: list[Sequence], device: torch.device) -> SamplingTensors:
    """Per-row tensors for ``seqs``; the sampled token lands at index ``seq.num_tokens``.

    The values are built on the host in one int64 and one float32 tensor, copied to the
    device once (see :func:`_to_device`) and sliced there. A ``seed`` of None draws a fresh
    random seed (the scheduler normally fills one in first).
    """
    params = [s.sampling for s in seqs]
    num_seqs = len(seqs)
    uses_penalty = any(
        p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params
    )
    int_values = [p.top_k for p in params]
    int_values += [
        _fold_seed(p.seed if p.seed is not None else secrets.randbits(32)) for p in params
    ]
    int_values += [s.num_tokens for s in seqs]
    widths = (0, 0)
    if uses_penalty:
        prompts = _padded([s.token_ids[: s.num_prompt_tokens] for s in seqs])
        outputs = _padded([s.generated_ids for s in seqs])
        widths = (len(prompts) // num_seqs, len(outputs) // num_seqs)
        int_values += prompts
        int_values += outputs
    greedy = [p.is_greedy for p in params]
    float_values = [0.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
    float_values += [p.top_p for p in params]
    float_values += [p.repetition_penalty for p in params]
    float_values += [p.frequency_penalty for p in params]
    float_values += [p.presence_penalty for p in params]
    uses_min_p = any(p.min_p > 0 for p in params)
    if uses_min_p:
        float_values += [p.min_p for p in params]
    ints, floats = _to_device(
        torch.tensor(int_values, dtype=torch.int64),
        torch.tensor(float_values, dtype=torch.float32),
        device,
    )
    top_k, seeds, positions = ints[: 3 * num_seqs].view(3, num_seqs).unbind(0)
    temperature, top_p, repetition, frequency, presence = (
        floats[: 5 * num_seqs].view(5, num_seqs).unbind(0)
    )
    t = SamplingTensors(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seeds=seeds,
        positions=positions,
        repetition_penalty=repetition,
        frequency_penalty=frequency,
        presence_penalty=presence,
        max_top_logprobs=max(p.top_logprobs if p.logprobs else 0 for p in params),
        need_logprobs=any(p.logprobs for p in params),
        host=HostFlags(
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            top_ks=frozenset(p.top_k for p in params if p.top_k > 0),
            any_top_p=any(p.top_p < 1.0 for p in params),
        ),
    )
    if uses_min_p:
        t.min_p = floats[5 * num_seqs :]
    if uses_penalty:
        prompt_end = 3 * num_seqs + num_seqs * widths[0]
        t.prompt_tokens = ints[3 * num_seqs : prompt_end].view(num_seqs, widths[0])
        t.output_tokens = ints[prompt_end:].view(num_seqs, widths[1])
    return t
