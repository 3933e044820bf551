"""Two-process test driver: runs a KVSender or a KVReceiver, controlled by JSON lines.

stdin: one command per line, ``{"id": n, "cmd": ..., ...}``; stdout: one JSON object per line,
either the reply ``{"id": n, "ok": ..., ...}`` or an event ``{"event": ..., ...}`` (room done,
pages released). The first line is ``{"event": "ready", ...}``. Pages are allocated and freed
with a real PageAllocator, filled with seeded random data, and compared by SHA-256 digest.

    python tests/transport/driver.py --role sender --engine-id prefill-0 --port 0 --hb 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import sys
import time
from typing import Any

import orjson
import torch

from pdserve.fsm import DuplicateRoomError, Room, RoomDeadlines
from pdserve.kernels.kv_cache import KVCacheConfig, KVPagePool, PageAllocator
from pdserve.transport.config import TransportConfig
from pdserve.transport.faults import FaultPlan
from pdserve.transport.receiver import KVReceiver
from pdserve.transport.sender import KVSender

KV = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=16)  # 4 KiB bf16 pages


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.buffer.write(orjson.dumps(obj) + b"\n")
    sys.stdout.buffer.flush()


def digest(pool: KVPagePool, pages: list[int]) -> str:
    index = torch.tensor(pages, dtype=torch.long, device=pool.kv.device)
    data = pool.kv[index].contiguous().cpu().view(torch.int16)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def fill(pool: KVPagePool, pages: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    shape = (len(pages), *pool.kv.shape[1:])
    index = torch.tensor(pages, dtype=torch.long, device=pool.kv.device)
    pool.kv[index] = torch.randn(shape, generator=gen).to(pool.kv.dtype).to(pool.kv.device)
    if pool.kv.device.type == "cuda":
        torch.cuda.synchronize(pool.kv.device)  # written before the transport reads them


class Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.pool = KVPagePool(KVCacheConfig(num_pages=args.num_pages, **KV), device=args.device)
        self.alloc = PageAllocator(args.num_pages)
        deadlines = RoomDeadlines(*(float(x) for x in args.deadlines.split(",")))
        faults = FaultPlan(delay_s=args.delay) if args.delay > 0 else None
        self.config = TransportConfig(
            engine_id=args.engine_id,
            bootstrap_port=args.port,
            heartbeat_interval_s=args.hb,
            abort_quarantine_s=args.quarantine,
            connect_timeout_s=args.connect_timeout,
            request_timeout_s=2.0,
            deadlines=deadlines,
            checksum=args.checksum,
            faults=faults,
            max_chunk_pages=args.chunk_pages,
        )
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self.rooms: dict[str, Room] = {}

    @property
    def endpoint(self) -> KVSender | KVReceiver:
        endpoint = self.sender or self.receiver
        assert endpoint is not None
        return endpoint

    async def start(self) -> None:
        if self.args.role == "sender":
            self.sender = KVSender(self.config, self.pool, self.on_release)
        else:
            self.receiver = KVReceiver(self.config, self.pool, self.on_release)
        await self.endpoint.start()
        port = self.sender.bootstrap_port if self.sender else None
        emit(
            {
                "event": "ready",
                "engine_id": self.config.engine_id,
                "incarnation": self.config.incarnation,
                "port": port,
                "pid": os.getpid(),
            }
        )

    def on_release(self, room_id: str, pages: list[int]) -> None:
        self.alloc.free(pages)
        emit({"event": "release", "room": room_id, "pages": len(pages), "t": time.monotonic()})

    def on_done(self, room: Room, fut: asyncio.Future[Any]) -> None:
        outcome = fut.result()
        event = {
            "event": "done",
            "room": room.room_id,
            "state": outcome.state.value,
            "reason": outcome.reason,
            "t": time.monotonic(),
        }
        if self.receiver is not None and outcome.state.value == "Success":
            pages = room.page_ids[: room.data["num_pages"]]
            event.update(first_token=room.data["first_token"], digest=digest(self.pool, pages))
            self.alloc.free(room.page_ids)  # the engine's pages after Success
        emit(event)

    # -- commands ------------------------------------------------------------------------------

    async def cmd_open(self, c: dict[str, Any]) -> dict[str, Any]:
        try:
            if self.sender is not None:
                room = self.sender.open_room(c["room"], c.get("req", c["room"]))
            else:
                assert self.receiver is not None
                pages = self.alloc.allocate(c["num_pages"])
                try:
                    room = await self.receiver.open_room(
                        c["room"], c.get("req", c["room"]), c["host"], c["port"], pages,
                        c.get("num_tokens", c["num_pages"] * KV["page_size"]),
                    )  # fmt: skip
                except Exception:
                    self.alloc.free(pages)
                    raise
        except DuplicateRoomError as e:
            return {"ok": False, "error": "duplicate", "message": str(e)}
        self.rooms[c["room"]] = room
        room.done.add_done_callback(lambda fut, r=room: self.on_done(r, fut))
        if c.get("abort_now"):  # same loop iteration: before any hand-shake step ran
            self.endpoint.abort(c["room"], "aborted before bootstrap")
        return {"ok": True, "state": room.state}

    async def cmd_send(self, c: dict[str, Any]) -> dict[str, Any]:
        assert self.sender is not None
        pages = self.alloc.allocate(c["num_pages"])
        if c.get("scatter"):  # non-contiguous source pages: take every other one
            extra = self.alloc.allocate(c["num_pages"])
            pages, spare = pages[::2] + extra[::2], pages[1::2] + extra[1::2]
            self.alloc.free(spare)
        fill(self.pool, pages, c["seed"])
        sent = self.sender.send(c["room"], pages, c["num_pages"] * KV["page_size"], c["token"])
        out = {"ok": sent, "digest": digest(self.pool, pages)}
        if not sent:
            self.alloc.free(pages)
        return out

    async def cmd_abort(self, c: dict[str, Any]) -> dict[str, Any]:
        return {"ok": self.endpoint.abort(c["room"], c.get("reason", "aborted"))}

    async def cmd_state(self, c: dict[str, Any]) -> dict[str, Any]:
        room = self.endpoint.table.get(c["room"])
        return {"ok": True, "state": None if room is None else room.state}

    async def cmd_wait_state(self, c: dict[str, Any]) -> dict[str, Any]:
        """Poll a room's state until it is ``state`` (or the room ended), with a deadline."""
        deadline = time.monotonic() + c.get("timeout", 5.0)
        while time.monotonic() < deadline:
            room = self.endpoint.table.get(c["room"])
            if room is None or room.state == c["state"]:
                return {"ok": room is not None, "state": None if room is None else room.state}
            await asyncio.sleep(0.002)
        return {"ok": False, "state": "timeout"}

    async def cmd_stats(self, c: dict[str, Any]) -> dict[str, Any]:
        return {
            "ok": True,
            "stats": self.endpoint.stats,
            "num_free": self.alloc.num_free,
            "num_live": len(self.endpoint.table),
            "peers": self.endpoint.debug_peers(),
        }

    async def handle(self, line: bytes) -> None:
        c = orjson.loads(line)
        try:
            reply = await getattr(self, f"cmd_{c['cmd']}")(c)
        except Exception as e:  # reported to the test, which decides
            reply = {"ok": False, "error": type(e).__name__, "message": str(e)}
        emit({"id": c["id"], **reply})


async def main(args: argparse.Namespace) -> None:
    driver = Driver(args)
    await driver.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: set[asyncio.Task[None]] = set()
    while line := await reader.readline():
        task = loop.create_task(driver.handle(line))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await driver.endpoint.stop()  # stdin closed: orderly shutdown
    emit({"event": "stopped", "t": time.monotonic()})


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["sender", "receiver"], required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--num-pages", type=int, default=256)
    p.add_argument("--device", default="cpu", help="where the KV pool lives: cpu or cuda[:N]")
    p.add_argument("--hb", type=float, default=0.2)
    p.add_argument("--quarantine", type=float, default=0.5)
    p.add_argument("--connect-timeout", type=float, default=0.5)
    p.add_argument("--deadlines", default="10,10,10")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--chunk-pages", type=int, default=0)
    p.add_argument("--checksum", action="store_true")
    p.add_argument("--log", default="WARNING")
    return p.parse_args()


if __name__ == "__main__":
    _args = parse_args()
    logging.basicConfig(level=_args.log, stream=sys.stderr, format="%(name)s %(message)s")
    asyncio.run(main(_args))
    # The transport has stopped; skip the interpreter's slow teardown of torch/UCX (~1.5 s).
    os._exit(0)
