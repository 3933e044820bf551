"""Real subprocess servers on 127.0.0.1 for end-to-end tests (demo model, real NIXL)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

READY_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    argv: list[str]
    url: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)

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
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health/ready", timeout=2) as r:
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


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("demo-model")
    subprocess.run(
        [sys.executable, "-m", "pdserve", "make-demo-model", str(path)], check=True, timeout=300
    )
    return path


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
    argv = ["router", "--port", str(port), "--health-interval", "0.5"]
    for p in prefills:
        argv += ["--prefill", p.url]
    for d in decodes:
        argv += ["--decode", d.url]
    return Proc("router", [*argv, *extra], f"http://127.0.0.1:{port}", tmp / "router.log")


@dataclass
class Cluster:
    prefill: Proc
    decode: Proc
    router: Proc

    @property
    def procs(self) -> list[Proc]:
        return [self.prefill, self.decode, self.router]


@pytest.fixture(scope="session")
def pd_cluster(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("pd")
    pre = worker(tmp, "prefill-0", "prefill", demo_model_dir).start()
    dec = worker(tmp, "decode-0", "decode", demo_model_dir).start()
    rt = router(tmp, [pre], [dec]).start()
    cluster = Cluster(pre, dec, rt)
    try:
        for p in cluster.procs:
            p.wait_ready()
        yield cluster
    finally:
        for p in reversed(cluster.procs):
            p.stop()


@pytest.fixture(scope="session")
def colocated(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("colo")
    p = worker(tmp, "colocated-0", "colocated", demo_model_dir).start()
    try:
        yield p.wait_ready()
    finally:
        p.stop()
