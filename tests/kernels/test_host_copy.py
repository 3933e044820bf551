"""The step's one host copy: packed results come back exactly as the tensors hold them."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.host_copy import PendingHostSample
from pdserve.kernels.sampling import SamplerOutput


def _output(device: str, num_top: int | None) -> SamplerOutput:
    gen = torch.Generator().manual_seed(num_top or 0)
    ids = torch.randint(0, 151_000, (6,), generator=gen)
    if num_top is None:
        return SamplerOutput(token_ids=ids.to(device))
    logprobs = -torch.rand(6, generator=gen) * 30
    out = SamplerOutput(token_ids=ids.to(device), logprobs=logprobs.to(device))
    if num_top:
        out.top_ids = torch.randint(0, 151_000, (6, num_top), generator=gen).to(device)
        out.top_logprobs = (-torch.rand(6, num_top, generator=gen) * 30).to(device)
    return out


@pytest.mark.parametrize("num_top", [None, 0, 3])  # ids only; ids + logprobs; + top-n
def test_packed_copy_round_trips_ids_and_logprobs_exactly(num_top: int | None, device: str) -> None:
    out = _output(device, num_top)
    packed = PendingHostSample(out, packed=True).wait()
    plain = PendingHostSample(SamplerOutput(**{k: v.cpu() if v is not None else None
                                               for k, v in vars(out).items()}),
                              packed=False).wait()  # fmt: skip
    assert packed == plain
    assert all(isinstance(t, int) for t in packed.token_ids)


def test_cpu_results_are_not_copied_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    copies = []
    original = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor, "copy_", lambda t, *a, **k: copies.append(1) or original(t, *a, **k)
    )
    host = PendingHostSample(_output("cpu", 2)).wait()  # CPU tensors already are host memory
    assert copies == [] and host.top_ids is not None
