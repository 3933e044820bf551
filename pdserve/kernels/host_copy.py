"""The step's one device->host copy: sampled ids, and logprobs when asked, as Python lists.

On CUDA, every ``.tolist()`` of a device tensor is a copy plus a sync. The step's results are
packed into one float64 tensor (token ids and float32 logprobs are exact in float64), copied
once into pinned host memory without blocking, and a CUDA event recorded after the copy; the
caller waits on that event only when it needs the lists. On the CPU the tensors already are
host memory: nothing is packed or copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.sampling import SamplerOutput


@dataclass
class HostSample:
    """:class:`SamplerOutput` as Python lists (row-aligned)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class PendingHostSample:
    """A step's output on its way to the host; :meth:`wait` gives the lists.

    ``packed`` (default: the output is not on the CPU) takes the one-copy path; the CPU path
    keeps the tensors as they are.
    """

    def __init__(self, out: SamplerOutput, packed: bool | None = None) -> None:
        device = out.token_ids.device
        self._out = out
        self._event: torch.cuda.Event | None = None
        self._host: torch.Tensor | None = None
        self._num_top = 0 if out.top_ids is None else out.top_ids.shape[1]
        if packed is None:
            packed = device.type != "cpu"
        if not packed:
            return
        is_cuda = device.type == "cuda"
        source = _pack(out)
        self._host = torch.empty(source.shape, dtype=source.dtype, pin_memory=is_cuda)
        self._host.copy_(source, non_blocking=is_cuda)
        if is_cuda:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))  # the copy's device

    def wait(self) -> HostSample:
        """The lists, once the copy has landed (blocks on the CUDA event, if any)."""
        if self._event is not None:
            self._event.synchronize()
        if self._host is None:
            return _lists(self._out)
        host = self._host
        if host.dim() == 1:  # token ids only
            return HostSample(token_ids=host.tolist())
        k = self._num_top
        return HostSample(
            token_ids=host[:, 0].long().tolist(),
            logprobs=host[:, 1].tolist(),
            top_ids=host[:, 2 : 2 + k].long().tolist() if k else None,
            top_logprobs=host[:, 2 + k :].tolist() if k else None,
        )


def _pack(out: SamplerOutput) -> torch.Tensor:
    if out.logprobs is None:
        return out.token_ids
    columns = [out.token_ids.unsqueeze(1), out.logprobs.unsqueeze(1)]
    if out.top_ids is not None and out.top_logprobs is not None:
        columns += [out.top_ids, out.top_logprobs]
    return torch.cat([c.double() for c in columns], dim=1)


def _lists(out: SamplerOutput) -> HostSample:
    return HostSample(
        token_ids=out.token_ids.tolist(),
        logprobs=out.logprobs.tolist() if out.logprobs is not None else None,
        top_ids=out.top_ids.tolist() if out.top_ids is not None else None,
        top_logprobs=out.top_logprobs.tolist() if out.top_logprobs is not None else None,
    )
