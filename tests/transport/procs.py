"""Test-side handle of a driver.py process: JSON-line commands, replies and events."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import orjson

from pdserve.envs import env_with_pythonpath

DRIVER = Path(__file__).with_name("driver.py")
REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 60.0  # importing torch on a loaded 2-core machine


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (for tests that must restart on the same port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DriverProc:
    """One driver process. Every wait has a timeout; a dead process fails waits at once."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.ready: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=80)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._changed = asyncio.Event()
        self._eof = False  # stdout closed: the process is gone or going
        self._readers = [
            asyncio.create_task(self._read_stdout()),
            asyncio.create_task(self._read_stderr()),
        ]

    @classmethod
    async def spawn(cls, role: str, engine_id: str, **opts: Any) -> DriverProc:
        """Start ``driver.py --role role`` and wait for its ready line."""
        argv = [sys.executable, str(DRIVER), "--role", role, "--engine-id", engine_id]
        for key, value in opts.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value is not False and value is not None:
                argv += [flag, str(value)]
        env = env_with_pythonpath(str(REPO))  # the parent's entries kept: carried wheels
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        driver = cls(proc, f"{role}:{engine_id}")
        driver.ready = await driver.wait_event("ready", within_s=READY_TIMEOUT_S)
        return driver

    @property
    def port(self) -> int:
        return int(self.ready["port"])

    @property
    def incarnation(self) -> str:
        return str(self.ready["incarnation"])

    async def cmd(self, cmd: str, within_s: float = 10.0, **kwargs: Any) -> dict[str, Any]:
        """Send one command and wait for its reply."""
        cid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[cid] = fut
        assert self.proc.stdin is not None
        self.proc.stdin.write(orjson.dumps({"id": cid, "cmd": cmd, **kwargs}) + b"\n")
        await self.proc.stdin.drain()
        try:
            return await asyncio.wait_for(fut, within_s)
        except TimeoutError:
            raise AssertionError(
                f"{self.name}: no reply to {cmd} in {within_s}s\n{self.log()}"
            ) from None

    async def wait_event(self, event: str, within_s: float = 10.0, **match: Any) -> dict[str, Any]:
        """The first event named ``event`` whose fields equal ``match`` (past or future)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            for ev in self.events:
                if ev.get("event") == event and all(ev.get(k) == v for k, v in match.items()):
                    return ev
            remaining = deadline - loop.time()
            if remaining <= 0 or self._eof:
                raise AssertionError(
                    f"{self.name}: no {event} event {match} within {within_s}s\n{self.log()}"
                )
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    def find(self, event: str, **match: Any) -> dict[str, Any] | None:
        """An event already received, or None."""
        for ev in self.events:
            if ev.get("event") == event and all(ev.get(k) == v for k, v in match.items()):
                return ev
        return None

    def log(self) -> str:
        return "".join(self.stderr_tail)

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to tell anyone."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)

    async def close(self, within_s: float = 10.0) -> None:
        """Orderly stop (stdin EOF), else kill; always reaps the process."""
        if self.proc.returncode is None and self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), within_s)
        except TimeoutError:
            self.kill()
            await self.proc.wait()
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)

    async def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            msg = orjson.loads(line)
            if "id" in msg:
                fut = self._pending.pop(msg["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            else:
                self.events.append(msg)
            self._changed.set()
        self._eof = True
        for fut in self._pending.values():  # the process died: fail waiters now
            if not fut.done():
                fut.set_exception(AssertionError(f"{self.name} exited\n{self.log()}"))
        self._changed.set()

    async def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.stderr_tail.append(line.decode("utf-8", "replace"))
