"""An engine's tensor-parallel ranks: rank 0 (the serving process) starts ranks 1..t-1, joins
their group, and sends each of them every forward step.

Rank 0 keeps everything that is not the model: the event loop, scheduler, page allocator,
sampler, HTTP and transport. Ranks 1..t-1 are ``python -m pdserve.parallel.rank_main``
processes holding their shard of the weights and their heads of the KV pool (the same page
ids). A step reaches them over their stdin pipe (:mod:`pdserve.parallel.step_wire`), the
model's collectives over the gloo group (:mod:`pdserve.parallel.group`).

Lifetime: a rank ends at the end of its pipe, which is closed when rank 0 closes the engine
or dies (the kernel closes a dead process's pipes); one blocked in a collective gets a broken
connection. A rank that dies fails rank 0's next step, or the one running, with the rank's
exit status: the engine is the unit, as in the design note. (Not PR_SET_PDEATHSIG: it fires
when the *thread* that started the child exits, and rank 0 may start ranks from a worker
thread.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.kernels import cpu_ext
from pdserve.kernels.kv_cache import KVCacheConfig, pool_shape
from pdserve.parallel.group import ShmRegion, TPGroup
from pdserve.parallel.row_parallel import TP
from pdserve.parallel.shm_gather import SLOT_ROWS, create_region
from pdserve.parallel.step_wire import SeqLike, StepKind, encode_step
from pdserve.runner_config import RunnerConfig

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0  # ranks import torch and join before loading: seconds, not minutes


class RankDied(RuntimeError):
    """A tensor-parallel rank of this engine is gone: the engine cannot compute any more."""


@dataclass(frozen=True)
class RankLaunch:
    """How rank ``rank`` > 0 finds its engine: rank 0's run directory (the group's file store
    and, with ``shm_slot_bytes`` > 0, the shared-memory gather region)."""

    rank: int
    run_dir: str
    shm_slot_bytes: int = 0

    @property
    def store_path(self) -> str:
        return os.path.join(self.run_dir, "store")

    @property
    def kv_path(self) -> str:
        """The engine's KV pool, every rank's heads (kernels/kv_cache.py head-major pages)."""
        return os.path.join(self.run_dir, "kv")

    @property
    def region(self) -> ShmRegion | None:
        path = os.path.join(self.run_dir, "gather")
        return ShmRegion(path, self.shm_slot_bytes) if self.shm_slot_bytes else None


def _run_dir() -> str:
    """On tmpfs where the machine has one: the gather region is memory shared by the ranks."""
    shm = "/dev/shm"
    return tempfile.mkdtemp(prefix="pdserve-tp-", dir=shm if os.path.isdir(shm) else None)


class RankProcesses:
    """Ranks 1..t-1 of one engine, started on construction."""

    def __init__(self, config: RunnerConfig, shm_slot_bytes: int, kv_bytes: int) -> None:
        self.size = config.tensor_parallel_size
        self._dir = _run_dir()
        self.launch = RankLaunch(0, self._dir, shm_slot_bytes)
        if self.launch.region is not None:
            create_region(self.launch.region.path, self.size, shm_slot_bytes)
        with open(self.launch.kv_path, "wb") as f:  # zeros, as a fresh pool is
            f.truncate(kv_bytes)
        payload = json.dumps(dataclasses.asdict(config))
        self._procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pdserve.parallel.rank_main",
                    "--rank",
                    str(rank),
                    "--run-dir",
                    self._dir,
                    "--shm-slot-bytes",
                    str(shm_slot_bytes),
                    "--config",
                    payload,
                    "--log-level",
                    str(logging.getLogger().getEffectiveLevel()),  # generate's WARNING
                ],
                stdin=subprocess.PIPE,
                close_fds=True,
            )  # fmt: skip
            for rank in range(1, self.size)
        ]
        self._lock = threading.Lock()  # steps are sent from one thread; close may be another
        # One pidfd per rank: readable once the rank exits, so a watcher (an event loop's
        # reader, a select) learns of a death without polling or reaping it.
        self.exit_fds = _pidfds(self._procs)

    def join_group(self) -> TPGroup:
        """Rank 0's place in the group, once every rank joined; RankDied if one exits first."""
        result: list[TPGroup | BaseException] = []

        def join() -> None:
            try:
                launch = self.launch
                group = TPGroup(
                    launch.store_path, 0, self.size, JOIN_TIMEOUT_S, launch.region,
                    self.check_alive,
                )  # fmt: skip
                result.append(group)
            except BaseException as e:  # handed to the waiting thread
                result.append(e)

        joiner = threading.Thread(target=join, name="pdserve-tp-join", daemon=True)
        joiner.start()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while joiner.is_alive() and time.monotonic() < deadline:
            self.check_alive()
            joiner.join(timeout=0.1)
        if not result:
            raise RankDied(f"tensor-parallel ranks did not join within {JOIN_TIMEOUT_S:.0f} s")
        if isinstance(result[0], BaseException):
            self.check_alive()
            raise RankDied(f"tensor-parallel group: {result[0]}") from result[0]
        return result[0]

    def check_alive(self) -> None:
        for rank, p in enumerate(self._procs, start=1):
            rc = p.poll()
            if rc is not None:
                raise RankDied(f"tensor-parallel rank {rank} exited (status {rc})")

    def wait_dead(self, timeout_s: float) -> RankDied | None:
        """The death of a rank, waiting up to ``timeout_s`` for one; None if all live on.

        For a step that failed in a collective: a SIGKILLed rank's sockets close a moment
        before its exit status can be read, and the status is the cause worth naming."""
        if self.exit_fds:
            select.select(self.exit_fds, [], [], timeout_s)
        try:
            self.check_alive()
        except RankDied as e:
            return e
        return None

    def send(
        self, kind: StepKind, threads: int, prefill: list[SeqLike], decode: list[SeqLike],
        rows: int = 0,
    ) -> None:  # fmt: skip
        """Hand every rank the step rank 0 is about to run."""
        frame = encode_step(kind, threads, prefill, decode, rows)
        with self._lock:
            for rank, p in enumerate(self._procs, start=1):
                assert p.stdin is not None
                try:
                    p.stdin.write(frame)
                    p.stdin.flush()
                except (BrokenPipeError, ValueError) as e:
                    raise RankDied(f"tensor-parallel rank {rank} is gone: {e}") from e

    def unlink_shared_files(self) -> None:
        """Once every rank has mapped them: the KV pool and gather region files leave
        /dev/shm (the mappings stay), so a killed engine leaks no memory there."""
        region = self.launch.region
        for path in (self.launch.kv_path, region.path if region else None):
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def close(self, timeout_s: float = 10.0) -> None:
        """End every rank (end of pipe), waiting ``timeout_s`` before killing one."""
        with self._lock:
            for p in self._procs:
                if p.stdin is not None and not p.stdin.closed:
                    with contextlib.suppress(BrokenPipeError):
                        p.stdin.close()
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank pid %d did not exit: killed", p.pid)
                p.kill()
                p.wait()
        for fd in self.exit_fds:
            os.close(fd)
        self.exit_fds = []
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]


def _pidfds(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    """A pidfd per process (Linux 5.3+); none where there are none: then a death is found
    by the next step (and :meth:`RankProcesses.wait_dead` returns at once)."""
    fds: list[int] = []
    try:
        for p in procs:
            fds.append(os.pidfd_open(p.pid))
    except (AttributeError, OSError):
        for fd in fds:
            os.close(fd)
        return []
    return fds


def threads_per_rank(tp_size: int) -> int:
    """Each rank's share of this process's cores (disjoint shares: ranks never wait on a
    neighbour's threads inside a step)."""
    return max(1, len(os.sched_getaffinity(0)) // tp_size)


def _parent_check() -> Callable[[], None]:
    """Raises once the process that started this rank is gone (its children are re-parented)."""
    parent = os.getppid()

    def check() -> None:
        if os.getppid() != parent:
            raise RankDied("tensor-parallel rank 0 is gone")

    return check


def _map_kv(path: str, kv: KVCacheConfig, fault_in: bool = False) -> torch.Tensor:
    """The engine's KV storage, mapped shared (every rank writes its heads into it).
    ``fault_in``: touch every page now (rank 0, once), as a private pool is: otherwise a room's
    first write into each page pays the page's allocation (measured: 6x a 4k-token room)."""
    shape = pool_shape(kv)
    storage = torch.from_file(path, shared=True, size=math.prod(shape), dtype=kv.dtype)
    if fault_in:
        storage.zero_()
    return storage.view(shape)


def start_tensor_parallel(
    config: RunnerConfig, kv: KVCacheConfig, hidden_size: int, launch: RankLaunch | None
) -> tuple[TP, RankProcesses | None, torch.Tensor | None]:
    """This rank's place in its engine's group, the other ranks (rank 0 only) and the KV
    storage the ranks share (None at TP1). ``launch``: how rank r > 0 was started; None for
    rank 0, which starts the other ranks first (they get the pool's page count explicitly:
    every rank addresses the same pages)."""
    size = config.tensor_parallel_size
    if size == 1:
        return TP(), None, None
    if torch.device(config.device).type != "cpu":
        raise ValueError(f"tensor_parallel_size {size}: only CPU engines split across ranks yet")
    if launch is not None:
        group = TPGroup(
            launch.store_path, launch.rank, size, JOIN_TIMEOUT_S, launch.region, _parent_check()
        )
        return TP(launch.rank, size, group), None, _map_kv(launch.kv_path, kv)
    # float32 activations (CPU): a slot holds SLOT_ROWS rows of the hidden size
    slot_bytes = SLOT_ROWS * hidden_size * 4 if cpu_ext.load() is not None else 0
    kv_bytes = math.prod(pool_shape(kv)) * torch.empty((), dtype=kv.dtype).element_size()
    ranks = RankProcesses(dataclasses.replace(config, num_pages=kv.num_pages), slot_bytes, kv_bytes)
    try:
        group = ranks.join_group()
    except BaseException:
        ranks.close(timeout_s=0)
        raise
    logger.info(
        "tensor-parallel: %d ranks (pids %s) joined; all-gather over %s", size, ranks.pids,
        "shared memory" if slot_bytes else "gloo",
    )  # fmt: skip

    def announce_logits(rows: int) -> None:
        ranks.send(StepKind.LOGITS, torch.get_num_threads(), [], [], rows)

    return TP(0, size, group, announce_logits), ranks, _map_kv(ranks.launch.kv_path, kv, True)
