"""The tensor-parallel ranks' collectives: a gloo process group over a file store, and the
all-gather through shared memory where the C++ module runs (gloo's costs ~1 ms a call on
loopback: pdserve.parallel.shm_gather).

Not torch.distributed's default group: a process may hold more than one engine (tests, an
offline ``LLM`` beside a server), so each engine's ranks own their group object and nothing
global. A file store in the engine's run directory needs no port (no race for one). Only the
model's collectives go through it, and only while every rank runs the same step; the steps
themselves reach the ranks over pipes (:mod:`pdserve.parallel.ranks`), which a rank blocks on
however long the engine idles.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed import FileStore, ProcessGroupGloo

from pdserve.parallel.shm_gather import ShmAllGather

# A collective waits this long for a peer inside one forward; one that dies mid-step breaks
# the connection, which fails the call at once: this bounds a peer that hangs.
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ShmRegion:
    """The engine's shared-memory region (made by rank 0) and its per-rank slot size."""

    path: str
    slot_bytes: int


def _no_check() -> None:
    pass


class TPGroup:
    """Rank ``rank`` of ``size`` in the group rendezvousing at ``store_path``.

    ``shm``: gather through this region instead of gloo; ``check_peers`` raises once a peer
    is gone (the shared-memory wait has no connection to break).
    """

    def __init__(
        self, store_path: str, rank: int, size: int, timeout_s: float,
        shm: ShmRegion | None = None, check_peers: Callable[[], None] = _no_check,
    ) -> None:  # fmt: skip
        self.rank, self.size = rank, size
        store = FileStore(store_path, size)
        opts = ProcessGroupGloo._Options()
        opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        # Blocks until every rank has joined (or raises after timeout_s).
        self._pg = ProcessGroupGloo(store, rank, size, opts)
        self._pg.set_timeout(datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        self._shm = None
        if shm is not None:
            self._shm = ShmAllGather(
                shm.path, rank, size, shm.slot_bytes, check_peers, COLLECTIVE_TIMEOUT_S
            )

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape and dtype everywhere), in rank order."""
        if self._shm is not None:
            return self._shm.all_gather(t)
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._pg.allgather([out], [t]).wait()
        return out

    def barrier(self) -> None:
        self._pg.barrier().wait()

    def shutdown(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._pg.shutdown()
