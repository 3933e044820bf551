"""The sync-free sampler (the device formulation): the same tokens as the CPU formulation, and
no host read of a device tensor in the step but the one final copy."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from pdserve.kernels.host_copy import PendingHostSample
from pdserve.kernels.sampling import _top_p_floor, _top_p_floor_sorted, sample
from pdserve.kernels.sampling_tensors import sampling_tensors_for
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence

# The ways a step could read a device tensor on the host (each one a sync on CUDA).
HOST_READS = ("item", "tolist", "nonzero", "numpy", "cpu", "__bool__", "__int__", "__float__",
              "__index__")  # fmt: skip


def _random_params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "temperature", "top_k", "top_p", "both", "penalties"])
    p = SamplingParams(seed=rng.randrange(2**40) if rng.random() < 0.8 else None)
    p.temperature = 0.0 if kind == "greedy" else rng.choice([0.3, 0.7, 1.0, 1.6])
    if kind in ("top_k", "both"):
        p.top_k = rng.choice([1, 5, 40, 63, 64, 65, 500])
    if kind in ("top_p", "both"):
        p.top_p = rng.choice([0.1, 0.5, 0.9, 0.99])
    if kind == "penalties":
        p.repetition_penalty = rng.choice([0.8, 1.3])
        p.frequency_penalty = rng.choice([0.0, 0.5])
        p.presence_penalty = rng.choice([0.0, -0.4, 1.0])
    if rng.random() < 0.3:
        p.logprobs, p.top_logprobs = True, rng.choice([0, 1, 5])
    return p


def _batch(seed: int, vocab: int) -> tuple[torch.Tensor, list[Sequence]]:
    rng = random.Random(seed)
    num_seqs = rng.choice([1, 3, 8, 17])
    gen = torch.Generator().manual_seed(seed)
    scale = rng.choice([0.3, 2.0, 8.0])  # flat .. peaked rows
    # bf16-rounded: ties at the top-k / top-p boundaries.
    logits = (torch.randn(num_seqs, vocab, generator=gen) * scale).bfloat16().float()
    seqs = []
    for i in range(num_seqs):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        out = [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))]
        seqs.append(Sequence(f"s{i}", prompt + out, len(prompt), _random_params(rng)))
    return logits, seqs


def _lists(logits: torch.Tensor, seqs: list[Sequence], sync_free: bool) -> object:
    t = sampling_tensors_for(seqs, logits.device)
    host = PendingHostSample(sample(logits, t, sync_free=sync_free)).wait()
    return host


@pytest.mark.parametrize("vocab", [50, 4096])  # at most / beyond the candidate width
@pytest.mark.parametrize("seed", range(40))
def test_sync_free_sampler_picks_the_cpu_sampler_tokens(seed: int, vocab: int) -> None:
    logits, seqs = _batch(seed, vocab)
    for s in seqs:  # unseeded rows draw fresh seeds: pin them so both runs see the same
        if s.sampling.seed is None:
            s.sampling.seed = seed
    cpu = _lists(logits, seqs, sync_free=False)
    device = _lists(logits, seqs, sync_free=True)
    assert device.token_ids == cpu.token_ids
    assert device.logprobs == cpu.logprobs
    assert device.top_ids == cpu.top_ids and device.top_logprobs == cpu.top_logprobs


@pytest.mark.parametrize("seed", range(8))
def test_sampler_on_each_device_agrees_with_the_cpu(seed: int, device: str) -> None:
    logits, seqs = _batch(seed, 4096)
    for s in seqs:
        s.sampling.seed = s.sampling.seed or seed
    cpu = _lists(logits, seqs, sync_free=False)
    here = _lists(logits.to(device), seqs, sync_free=device != "cpu")
    # Kernels may round differently off the CPU: a borderline row may flip, not a batch.
    same = sum(a == b for a, b in zip(here.token_ids, cpu.token_ids, strict=True))
    assert same >= len(seqs) - (0 if device == "cpu" else 1)
    if cpu.logprobs is not None:
        assert here.logprobs == pytest.approx(cpu.logprobs, abs=1e-4)


@pytest.mark.parametrize("seed", range(10))
def test_host_flags_say_what_the_tensors_say(seed: int) -> None:
    _, seqs = _batch(seed, 4096)
    t = sampling_tensors_for(seqs, torch.device("cpu"))
    assert t.host is not None
    built = t.host
    t.host = None
    assert t.host_flags() == built


def test_the_sorted_top_p_floor_equals_the_bisection_one(device: str) -> None:
    """The devices' sort and the CPU's bisection pick the same floor: flat and peaked rows, ties
    (bf16-rounded logits, a uniform row), the edges of top_p (tiny, exactly a prefix's mass, 1)."""
    gen = torch.Generator().manual_seed(3)
    for scale in (0.0, 0.01, 1.0, 8.0, 20.0):
        logits = (torch.randn(16, 3000, generator=gen) * scale).bfloat16().float()
        probs = logits.softmax(dim=1)
        top_p = torch.rand(16, generator=gen)
        top_p[:4] = torch.tensor([1e-6, 1.0, 0.5, 0.999999])
        top_p[4] = probs[4].sort(descending=True).values[:7].double().sum().float()
        want = _top_p_floor(probs, top_p)
        got = _top_p_floor_sorted(probs.to(device), top_p.to(device)).cpu()
        assert torch.equal(got, want), scale
    dyadic = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.25] * 4])  # masses hit top_p exactly
    for p in (0.5, 0.75, 0.875, 0.25):
        top_p = torch.full((2,), p)
        assert torch.equal(_top_p_floor_sorted(dyadic, top_p), _top_p_floor(dyadic, top_p)), p


@contextmanager
def _counting_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    counts = {name: 0 for name in (*HOST_READS, "copy_")}
    for name in counts:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: object, _n: str = name, _f=original, **k: object):
            counts[_n] += 1
            return _f(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    yield counts
    monkeypatch.undo()


@pytest.mark.parametrize("seed", [0, 5, 11, 23])
def test_the_step_reads_nothing_on_the_host_but_its_one_copy(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    logits, seqs = _batch(seed, 4096)
    for s in seqs:
        s.sampling.seed = seed
        s.sampling.logprobs, s.sampling.top_logprobs = True, 2  # every output column
    s = seqs[0].sampling
    s.top_k, s.top_p, s.repetition_penalty = 7, 0.8, 1.2  # every branch of the step
    reference = _lists(logits, seqs, sync_free=False)
    with _counting_host_reads(monkeypatch) as counts:
        t = sampling_tensors_for(seqs, logits.device)
        pending = PendingHostSample(sample(logits, t, sync_free=True), packed=True)
        in_step = dict(counts)
    assert {n: c for n, c in in_step.items() if c and n != "copy_"} == {}
    assert in_step["copy_"] == 1
    host = pending.wait()  # after the copy: host-side lists
    assert host.token_ids == reference.token_ids
    assert host.logprobs == reference.logprobs and host.top_ids == reference.top_ids
