"""Cost of a KV room's life in pdserve.fsm: time per room, memory per live room, vs the naive way.

Runs every scenario in one process, in well under 30 s (``--quick``: a few seconds, for CI):

* success path: create + bootstrapped + begin_transfer + 2x chunk_sent + transfer_done + release,
  for N rooms pipelined so that ``--live`` rooms are live at once (every state populated);
* failure path: create + bootstrapped + begin_transfer + chunk_sent + fail("aborted") + release;
* the success path on a small set of rooms, on the lean and on the stock shared Machine;
* memory per live room (tracemalloc, rooms parked in Bootstrapping with armed deadlines);
* the naive alternative, one ``transitions.Machine`` per room (auto_transitions off), on a bare
  model without timers/futures/release, so the printed ratio understates our advantage.

Loop time runs as usual: every 1000 rooms the bench yields to the event loop, so cancelled
deadline timers are purged as they would be in a server. Logging stays at WARNING.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass

import orjson
from transitions import Machine

from pdserve.fsm import RoomSide, RoomTable
from pdserve.fsm.machine import TRANSITIONS
from pdserve.fsm.room import RoomState

YIELD_EVERY = 1000
NAIVE_REPEATS = 3
NAIVE = "naive: Machine per room"

SUCCESS_STEPS = ("bootstrapped", "begin_transfer", "chunk_sent", "chunk_sent", "transfer_done")
FAILURE_STEPS = ("bootstrapped", "begin_transfer", "chunk_sent")


@dataclass
class Row:
    scenario: str
    num_rooms: int
    max_live: int
    us_per_room: float  # CPU time of this process, median over repeats
    us_per_room_min: float  # CPU time, best repeat
    wall_us_per_room: float  # wall clock, median (inflated when other processes share the CPUs)


async def _pipeline(
    table: RoomTable, ids: list[str], steps: tuple[str, ...], live: int, fail: bool
):
    """Room i is created at step i and its k-th trigger fires at step i + k * lag, so about
    ``live`` rooms are alive at once, spread over every state. Returns the peak live count."""
    num_rooms = len(ids)
    num_stages = len(steps) + 1  # the last stage is the fail() when ``fail``
    lag = max(1, live // (num_stages if fail else len(steps)))
    fire = table.fire
    peak = 0
    for step in range(num_rooms + num_stages * lag):
        if step < num_rooms:
            table.create(ids[step], request_id=ids[step])
        for k, trigger in enumerate(steps, start=1):
            i = step - k * lag
            if 0 <= i < num_rooms:
                fire(ids[i], trigger)
        i = step - num_stages * lag
        if fail and 0 <= i < num_rooms:
            table.fail(ids[i], "aborted")
        if step % YIELD_EVERY == 0:
            peak = max(peak, len(table))
            await asyncio.sleep(0)  # a yield, not a wait: lets the loop purge cancelled timers
    assert len(table) == 0, "every room must have finished"
    return peak


async def _time_lives(steps, num_rooms: int, live: int, fail: bool, lean: bool, repeats: int):
    ids = [f"room-{i}" for i in range(num_rooms)]
    cpu, wall, peak = [], [], 0
    for _ in range(repeats):
        released: list[object] = []
        table = RoomTable(RoomSide.SENDER, on_release=released.append, lean_machine=lean)
        gc.collect()
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        peak = await _pipeline(table, ids, steps, live, fail)
        cpu.append((time.process_time() - start_cpu) / num_rooms * 1e6)
        wall.append((time.perf_counter() - start_wall) / num_rooms * 1e6)
        expected_ok = 0 if fail else num_rooms
        assert len(released) == num_rooms and table.stats.succeeded == expected_ok
    return statistics.median(cpu), min(cpu), statistics.median(wall), peak


async def _bytes_per_live_room(num_rooms: int) -> float:
    ids = [f"mem-{i}" for i in range(num_rooms)]  # ids belong to the caller, not the table
    table = RoomTable(RoomSide.RECEIVER)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for room_id in ids:
        table.create(room_id)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    table.close()
    return used / num_rooms


class _NaiveRoom:
    pass


def _naive_machine(model: object) -> Machine:
    return Machine(
        model=model,
        states=[s.value for s in RoomState],
        transitions=[dict(t) for t in TRANSITIONS],
        initial=RoomState.BOOTSTRAPPING.value,
        auto_transitions=False,
    )


def _time_naive(num_rooms: int, repeats: int) -> tuple[float, float, float]:
    cpu, wall = [], []
    for _ in range(repeats):
        gc.collect()
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        for _ in range(num_rooms):
            room = _NaiveRoom()
            _naive_machine(room)
            for trigger in SUCCESS_STEPS:
                getattr(room, trigger)()
            assert room.state == "Success"
        cpu.append((time.process_time() - start_cpu) / num_rooms * 1e6)
        wall.append((time.perf_counter() - start_wall) / num_rooms * 1e6)
    return statistics.median(cpu), min(cpu), statistics.median(wall)


def _naive_bytes_per_room(num_rooms: int) -> float:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    keep = []
    for _ in range(num_rooms):
        room = _NaiveRoom()
        keep.append((room, _naive_machine(room)))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / num_rooms


async def run(num_rooms: int, live: int, num_naive: int, repeats: int) -> dict:
    rows: list[Row] = []
    for name, steps, fail in (("success", SUCCESS_STEPS, False), ("failure", FAILURE_STEPS, True)):
        # The failure path is a secondary number: one pass keeps the whole run short.
        runs = repeats if not fail else 1
        cpu, best, wall, peak = await _time_lives(steps, num_rooms, live, fail, True, runs)
        rows.append(Row(name, num_rooms, peak, round(cpu, 2), round(best, 2), round(wall, 2)))
    # The comparison block: same small size for every variant, all rooms live at once.
    small = await _time_lives(SUCCESS_STEPS, num_naive, num_naive, False, True, NAIVE_REPEATS)
    stock = await _time_lives(SUCCESS_STEPS, num_naive, num_naive, False, False, NAIVE_REPEATS)
    naive = _time_naive(num_naive, NAIVE_REPEATS)
    for name, (cpu, best, wall, *_) in (
        ("success, lean shared Machine", small),
        ("success, stock shared Machine", stock),
        (NAIVE, naive),
    ):
        rows.append(Row(name, num_naive, num_naive, round(cpu, 2), round(best, 2), round(wall, 2)))
    bytes_live = await _bytes_per_live_room(live)
    naive_bytes = _naive_bytes_per_room(min(num_naive, 1000))
    return {
        "rows": [asdict(r) for r in rows],
        "bytes_per_live_room": round(bytes_live),
        "naive_bytes_per_room": round(naive_bytes),
        "naive_over_table_time": round(naive[0] / small[0], 2),
        "naive_over_table_bytes": round(naive_bytes / bytes_live, 2),
        "stock_over_lean_time": round(stock[0] / small[0], 2),
        "goal_us_per_room": 50.0,
        "python": sys.version.split()[0],
    }


def _print_table(result: dict) -> None:
    print(
        f"{'scenario':32} {'rooms':>6} {'max live':>8} {'cpu us/room':>11} {'min':>7} {'wall':>7}"
    )
    for r in result["rows"]:
        print(
            f"{r['scenario']:32} {r['num_rooms']:>6} {r['max_live']:>8}"
            f" {r['us_per_room']:>11.2f} {r['us_per_room_min']:>7.2f} {r['wall_us_per_room']:>7.2f}"
        )
    print(
        f"memory per live room: {result['bytes_per_live_room']} B"
        f" (naive Machine per room: {result['naive_bytes_per_room']} B,"
        f" x{result['naive_over_table_bytes']})"
    )
    num_naive = result["rows"][-1]["num_rooms"]
    print(
        f"per room, same {num_naive} rooms: naive / table x{result['naive_over_table_time']},"
        f" stock / lean shared Machine x{result['stock_over_lean_time']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON only")
    parser.add_argument("--quick", action="store_true", help="small sizes for CI (a few seconds)")
    args = parser.parse_args(argv)
    if args.quick:
        sizes = {"num_rooms": 5_000, "live": 1_000, "num_naive": 500, "repeats": 1}
    else:
        sizes = {"num_rooms": 50_000, "live": 10_000, "num_naive": 2_000, "repeats": 2}
    result = asyncio.run(run(**sizes))
    if args.json:
        print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    else:
        _print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
