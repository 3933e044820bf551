"""KV transfer across processes through KVAgent (real NIXL/UCX) vs a plain in-process torch copy.

The parent is the prefill sender, a child process (this file, ``--child``) the decode receiver;
they exchange agent metadata and pool descriptors as JSON lines over the child's stdin/stdout.
One pool per page size on each side. For every case (page size x pages, contiguous or
scattered page ids) the parent times ``KVAgent.write`` of one room, and, in the same run,
``dst.copy_(src)`` (contiguous) / ``dst.index_copy_`` (scattered, source pre-gathered) of the
same bytes in one thread: the memory-bandwidth limit. Per-room overhead is the latency of
one-page rooms, one at a time and pipelined; the child timestamps each notification so the
time until the receiver knows is reported too. Bootstrap (agent start, add_peer) is excluded.

    .venv/bin/python bench/transfer.py            # full: rooms of 1 MiB .. 256 MiB (~1 min)
    .venv/bin/python bench/transfer.py --quick    # CI: up to 16 MiB, few reps (< 20 s)
    .venv/bin/python bench/transfer.py --json     # machine-readable
Levers: --error-mode peer|none, --num-threads N, --no-merge, --hugepages (pools on THP memory),
and UCX_* environment variables (inherited by the child).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.kernels.kv_cache import KVCacheConfig, KVPagePool, hugepage_zeros  # noqa: E402
from pdserve.transport.nixl_agent import KVAgent, KVAgentConfig, PoolDescriptor  # noqa: E402

KIB, MIB = 1024, 1024 * 1024
IO_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Case:
    page_kib: int
    num_pages: int
    layout: str  # "contiguous" | "scattered"


@dataclass
class Result:
    page_kib: int
    num_pages: int
    layout: str
    room_mib: float
    nixl_gbps: float
    copy_gbps: float
    ratio: float
    nixl_p50_us: float


def pools_for(quick: bool) -> dict[int, int]:
    """Pages per pool, by page size in KiB: big enough for the largest room, and for scatter."""
    return {16: 512, 64: 256, 256: 256 if quick else 1024}


def cases_for(quick: bool) -> list[Case]:
    sizes = [(16, 64), (64, 64), (256, 64)] + ([] if quick else [(256, 256), (256, 1024)])
    return [Case(p, n, lay) for p, n in sizes for lay in ("contiguous", "scattered")]


def make_pool(page_kib: int, num_pages: int, hugepages: bool) -> KVPagePool:
    # bf16, 16 tokens, 1 head: head_dim sets the page size (page_bytes = 64 * head_dim)
    cfg = KVCacheConfig(1, 1, page_kib * KIB // 64, num_pages, 16, torch.bfloat16)
    return KVPagePool(cfg, hugepages=hugepages)


def agent_config(args: argparse.Namespace) -> KVAgentConfig:
    return KVAgentConfig(
        num_threads=args.num_threads,
        ucx_error_handling_mode=args.error_mode,
        merge_descs=not args.no_merge,
        hot_wait_s=args.hot_wait_us * 1e-6,
    )


# -- the receiving child -------------------------------------------------------------------------


async def child_main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    arrivals: list[tuple[int, float]] = []
    report = loop.create_future()

    def on_notif(_name: str, msg: bytes) -> None:
        now = time.monotonic()  # CLOCK_MONOTONIC is shared by the processes of one host
        body = orjson.loads(msg)
        if "report" in body:
            report.done() or report.set_result(None)
        else:
            arrivals.append((body["seq"], now))

    agents = []
    for page_kib, num_pages in pools_for(args.quick).items():
        pool = make_pool(page_kib, num_pages, args.hugepages)
        agent = KVAgent(f"bench-rx-{page_kib}k", pool, loop, on_notif, agent_config(args))
        agent.start()
        agents.append(agent)
        hello = {"page_kib": page_kib, "name": agent.name, "descriptor": agent.descriptor.to_json(),
                 "metadata": base64.b64encode(agent.metadata).decode()}  # fmt: skip
        print(orjson.dumps(hello).decode(), flush=True)
    await asyncio.wait_for(report, 3600)
    print(orjson.dumps({"arrivals": arrivals}).decode(), flush=True)
    for agent in agents:
        await agent.close()


# -- the sending parent --------------------------------------------------------------------------


def page_ids(case: Case, pool_pages: int, seed: int) -> tuple[list[int], list[int]]:
    if case.layout == "contiguous":
        ids = list(range(case.num_pages))
        return ids, ids
    rng = np.random.default_rng(seed)  # independent random pages: (almost) nothing coalesces
    src = rng.choice(pool_pages, case.num_pages, replace=False)
    dst = rng.choice(pool_pages, case.num_pages, replace=False)
    return src.tolist(), dst.tolist()


def copy_fn(
    src_pool: KVPagePool, src: list[int], dst: list[int], hugepages: bool
) -> Callable[[], object]:
    """One in-process copy of the room's bytes in this thread: the bandwidth limit."""
    kv = src_pool.kv
    target = hugepage_zeros(tuple(kv.shape), kv.dtype) if hugepages else torch.empty_like(kv)
    if src == dst == list(range(len(src))):
        a, b = src_pool.kv[: len(src)], target[: len(src)]
        return lambda: b.copy_(a)
    gathered = src_pool.kv.index_select(0, torch.tensor(src))  # outside the timing: one pass
    d_idx = torch.tensor(dst)
    return lambda: target.index_copy_(0, d_idx, gathered)


async def time_case(agent: KVAgent, peer: str, src: list[int], dst: list[int],
                    args: argparse.Namespace, reps: int, seq: list[int]
                    ) -> tuple[float, float]:  # fmt: skip
    """Median seconds of one write and of one copy, interleaved so both see the same load."""
    copy = copy_fn(agent.pool, src, dst, args.hugepages)
    t_write, t_copy = [], []
    for i in range(reps + 1):  # the first round warms both paths
        seq[0] += 1
        t0 = time.perf_counter()
        await agent.write(peer, src, dst, orjson.dumps({"seq": seq[0]}))
        t1 = time.perf_counter()
        copy()
        t2 = time.perf_counter()
        if i:
            t_write.append(t1 - t0)
            t_copy.append(t2 - t1)
    return statistics.median(t_write), statistics.median(t_copy)


async def room_overhead(agent: KVAgent, peer: str, num_rooms: int, seq: list[int]
                        ) -> tuple[list[float], dict[int, float], dict]:  # fmt: skip
    """One-page rooms one at a time (latencies, start times by seq) and pipelined (us/room)."""
    lat, starts = [], {}
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for i in range(num_rooms):
        seq[0] += 1
        starts[seq[0]] = time.monotonic()
        t0 = time.perf_counter()
        await agent.write(peer, [i % 64], [i % 64], orjson.dumps({"seq": seq[0]}))
        lat.append(time.perf_counter() - t0)
    cpu_per_room = (time.process_time() - cpu0) / num_rooms
    busy = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    t0 = time.perf_counter()
    writes = []
    for i in range(num_rooms):
        seq[0] += 1
        writes.append(agent.write(peer, [i % 64], [(i + 7) % 64], orjson.dumps({"seq": seq[0]})))
    await asyncio.gather(*writes)
    pipelined = (time.perf_counter() - t0) / num_rooms
    return lat, starts, {"pipelined_us_per_room": pipelined * 1e6,
                         "sender_cpu_us_per_room": cpu_per_room * 1e6,
                         "sender_cpu_busy": busy}  # fmt: skip


async def read_line(proc: asyncio.subprocess.Process) -> dict:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), IO_TIMEOUT_S)
    if not line:
        raise RuntimeError("receiver process exited")
    return orjson.loads(line)


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1e6


async def parent_main(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.copy_threads)
    child_argv = [a for a in sys.argv[1:] if a != "--json"] + ["--child"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, *child_argv, stdout=asyncio.subprocess.PIPE
    )
    loop = asyncio.get_running_loop()
    agents: dict[int, tuple[KVAgent, str]] = {}
    try:
        for page_kib, num_pages in pools_for(args.quick).items():
            hello = await read_line(proc)
            pool = make_pool(page_kib, num_pages, args.hugepages)
            tx = KVAgent(
                f"bench-tx-{page_kib}k", pool, loop, lambda _n, _m: None, agent_config(args)
            )
            tx.start()
            tx.pool.kv.copy_(torch.randn(tx.pool.kv.shape))
            desc = PoolDescriptor.from_json(hello["descriptor"])
            await tx.add_peer(hello["name"], base64.b64decode(hello["metadata"]), desc)
            agents[page_kib] = (tx, hello["name"])
        seq = [0]
        results = []
        for case in cases_for(args.quick):
            tx, peer = agents[case.page_kib]
            src, dst = page_ids(case, tx.pool.config.num_pages, seed=case.num_pages)
            reps = args.reps if case.num_pages * case.page_kib <= 16 * 1024 else 5
            t_nixl, t_copy = await time_case(tx, peer, src, dst, args, reps, seq)
            nbytes = case.num_pages * case.page_kib * KIB
            results.append(Result(case.page_kib, case.num_pages, case.layout, nbytes / MIB,
                                  nbytes / t_nixl / 1e9, nbytes / t_copy / 1e9, t_copy / t_nixl,
                                  t_nixl * 1e6))  # fmt: skip
        tx, peer = agents[16]
        lat, starts, extra = await room_overhead(tx, peer, args.rooms, seq)
        await tx.send_notif(peer, orjson.dumps({"report": 1}))
        arrivals = dict((await read_line(proc))["arrivals"])
        notif_lat = [arrivals[s] - t for s, t in starts.items() if s in arrivals]
        overhead = {
            "write_p50_us": pct(lat, 0.5), "write_p90_us": pct(lat, 0.9),
            "notif_p50_us": pct(notif_lat, 0.5), "notif_p90_us": pct(notif_lat, 0.9),
            "num_rooms": args.rooms, **extra,
        }  # fmt: skip
    finally:
        for tx, _ in agents.values():
            await tx.close()
        if proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    return {
        "config": vars(args),
        "load_avg_1m": os.getloadavg()[0],
        "num_cpus": os.cpu_count(),
        "results": [asdict(r) for r in results],
        "overhead": overhead,
    }


def print_report(out: dict) -> None:
    cfg = out["config"]
    print(f"error_mode={cfg['error_mode']} num_threads={cfg['num_threads']} "
          f"merge={not cfg['no_merge']} hugepages={cfg['hugepages']} "
          f"hot_wait_us={cfg['hot_wait_us']:.0f} "
          f"copy_threads={cfg['copy_threads']} "
          f"load_avg_1m={out['load_avg_1m']:.1f} cpus={out['num_cpus']}")  # fmt: skip
    print(f"{'page':>6} {'pages':>5} {'layout':>10} {'room':>8} {'nixl GB/s':>10} "
          f"{'copy GB/s':>10} {'ratio':>6} {'write p50':>10}")  # fmt: skip
    for r in out["results"]:
        print(f"{r['page_kib']:>4}Ki {r['num_pages']:>5} {r['layout']:>10} "
              f"{r['room_mib']:>6.0f}Mi {r['nixl_gbps']:>10.2f} {r['copy_gbps']:>10.2f} "
              f"{r['ratio']:>6.2f} {r['nixl_p50_us']:>8.0f}us")  # fmt: skip
    o = out["overhead"]
    print(f"per-room overhead (1-page 16 KiB rooms, n={o['num_rooms']}): write p50 "
          f"{o['write_p50_us']:.0f} us, p90 {o['write_p90_us']:.0f} us; receiver notified p50 "
          f"{o['notif_p50_us']:.0f} us, p90 {o['notif_p90_us']:.0f} us; pipelined "
          f"{o['pipelined_us_per_room']:.0f} us/room; sender CPU {o['sender_cpu_us_per_room']:.0f}"
          f" us/room (one at a time, {100 * o['sender_cpu_busy']:.0f}% of a core)")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI size: rooms up to 16 MiB, < 20 s")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--reps", type=int, default=None, help="timed writes per case")
    p.add_argument("--rooms", type=int, default=None, help="one-page rooms for the overhead")
    p.add_argument("--error-mode", default="none", choices=("none", "peer"))
    p.add_argument("--num-threads", type=int, default=0, help="UCX backend threads")
    p.add_argument("--no-merge", action="store_true", help="skip NIXL descriptor merging")
    p.add_argument("--hot-wait-us", type=float, default=KVAgentConfig().hot_wait_s * 1e6,
                   help="agent poll period right after activity")  # fmt: skip
    p.add_argument(
        "--hugepages",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pools on MADV_HUGEPAGE memory, as KVPagePool does by default (--no-hugepages: plain)",
    )
    p.add_argument("--copy-threads", type=int, default=1, help="torch threads of the copy")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.reps = args.reps or (5 if args.quick else 20)
    args.rooms = args.rooms or (100 if args.quick else 400)
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        asyncio.run(child_main(args))
        return
    out = asyncio.run(parent_main(args))
    if args.json:
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    else:
        print_report(out)


if __name__ == "__main__":
    main()
