"""The processes of the end-to-end tests: pdserve workers and routers started as real
subprocesses (``python -m pdserve``), their ports, readiness and logs."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

READY_TIMEOUT_S = 180.0
ROUTER_PD_READY = "/health/pd"  # 200 once a prefill+decode pair is up (not the fallback)


_GIVEN_PORTS: set[int] = set()


def free_port() -> int:
    """A free 127.0.0.1 port not handed out before in this test session (the OS may offer a
    just-closed port twice; two servers on one port would fail to start)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


@dataclass
class Proc:
    name: str
    argv: list[str]
    url: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    # A router's /health/ready counts the decode fallback; tests wait for the PD path.
    ready_path: str = "/health/ready"
    cafile: str | None = None  # an https url: its readiness probe trusts this CA

    def start(self) -> Proc:
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed when the process is reaped
        env = {**os.environ, "PDSERVE_LOG_LEVEL": "INFO", **self.env}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", *self.argv],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> Proc:
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        ctx = ssl.create_default_context(cafile=self.cafile) if self.cafile else None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                url = f"{self.url}{self.ready_path}"
                with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(delay)  # readiness poll with a deadline
            delay = min(delay * 2, 0.5)
        raise TimeoutError(f"{self.name} not ready:\n{self.log_tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


WORKER_ARGS = ["--kv-cache-mb", "64", "--num-threads", "1", "--heartbeat-interval", "0.5"]


def worker(tmp: Path, name: str, role: str, model: Path, *extra: str) -> Proc:
    port = free_port()
    argv = ["serve", "--role", role, "--model", str(model), "--served-model-name", "demo",
            "--port", str(port), "--engine-id", name, *WORKER_ARGS, *extra]  # fmt: skip
    if role == "prefill":
        argv += ["--bootstrap-port", str(free_port())]
    return Proc(name, argv, f"http://127.0.0.1:{port}", tmp / f"{name}.log")


def router(tmp: Path, prefills: list[Proc], decodes: list[Proc], *extra: str) -> Proc:
    port = free_port()
    # Round robin: these tests drain or kill one worker of a role under load and need the load
    # on every one (auto would send identical prompts to one; tests/router covers it).
    policy = [] if "--policy" in extra else ["--policy", "round_robin"]
    argv = ["router", "--port", str(port), "--health-interval", "0.5", *policy]
    for p in prefills:
        argv += ["--prefill", p.url]
    for d in decodes:
        argv += ["--decode", d.url]
    url, log = f"http://127.0.0.1:{port}", tmp / "router.log"
    return Proc("router", [*argv, *extra], url, log, ready_path=ROUTER_PD_READY)


@dataclass
class Cluster:
    prefill: Proc
    decode: Proc
    router: Proc

    @property
    def procs(self) -> list[Proc]:
        return [self.prefill, self.decode, self.router]

    @contextmanager
    def running(self) -> Iterator[Cluster]:
        """Start every process, wait until each is ready, and stop them (router first) after."""
        with running(self.procs):
            yield self


@contextmanager
def running(procs: list[Proc]) -> Iterator[list[Proc]]:
    """Start ``procs`` at once, wait until each is ready, and stop them in reverse order after."""
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in reversed(procs):
            p.stop()


PORT_FLAGS = ("--port", "--bootstrap-port")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: all held at once, so no two are the same."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def assign_distinct_ports(procs: list[Proc]) -> None:
    """Give every ``--port`` and ``--bootstrap-port`` of ``procs`` its own free port (call before
    starting them). ``worker`` and ``router`` pick each port alone, so two picks can collide;
    router arguments naming a worker URL follow the worker's new port."""
    slots = [(p, i) for p in procs for i, a in enumerate(p.argv) if a in PORT_FLAGS]
    renamed: dict[str, str] = {}
    for (p, i), port in zip(slots, free_ports(len(slots)), strict=True):
        p.argv[i + 1] = str(port)
        if p.argv[i] == "--port":
            new_url = f"http://127.0.0.1:{port}"
            renamed[p.url] = new_url
            p.url = new_url
    for p in procs:
        p.argv = [renamed.get(a, a) for a in p.argv]
