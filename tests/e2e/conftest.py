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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

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
                with urllib.request.urlopen(f"{self.url}{self.ready_path}", timeout=2) as r:
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
        try:
            for p in self.procs:
                p.start()
            for p in self.procs:
                p.wait_ready()
            yield self
        finally:
            for p in reversed(self.procs):
                p.stop()


@pytest.fixture(scope="session")
def pd_cluster(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("pd")
    pre = worker(tmp, "prefill-0", "prefill", demo_model_dir)
    dec = worker(tmp, "decode-0", "decode", demo_model_dir)
    with Cluster(pre, dec, router(tmp, [pre], [dec])).running() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def colocated(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("colo")
    p = worker(tmp, "colocated-0", "colocated", demo_model_dir).start()
    try:
        yield p.wait_ready()
    finally:
        p.stop()


# ---- live-server helpers of the restart, hostile-input and observability tests (appended) -------
# Imported here rather than at the top: this block was appended to a shared file.
import asyncio  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from typing import Any  # noqa: E402

import aiohttp  # noqa: E402
import orjson  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

QUEUE_GAUGES = (
    "pdserve_waiting_requests",
    "pdserve_running_requests",
    "pdserve_prefill_inflight_requests",
    "pdserve_decode_waiting_for_kv_requests",
)


@dataclass
class Metrics:
    """One parsed /metrics scrape: samples by name, plus the declared family names."""

    samples: dict[str, list[tuple[dict[str, str], float]]]
    families: set[str]

    def get(self, name: str, **labels: str) -> float | None:
        """The value of the one sample of ``name`` whose labels include ``labels``."""
        found = [v for lab, v in self.samples.get(name, []) if labels.items() <= lab.items()]
        assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
        return found[0] if found else None

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
        return sum(v for lab, v in self.samples.get(name, []) if labels.items() <= lab.items())

    def by_label(self, name: str, label: str) -> dict[str, float]:
        return {lab[label]: v for lab, v in self.samples.get(name, []) if label in lab}


def parse_metrics(text: str) -> Metrics:
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    families: set[str] = set()
    for family in text_string_to_metric_families(text):
        families.add(family.name)
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), s.value))
    return Metrics(samples, families)


async def fetch(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> tuple[int, bytes]:
    """One HTTP call on an aiohttp session: (status, body) whatever the status.

    ``body``: bytes are sent as they are, anything else as JSON.
    """
    data = body if isinstance(body, bytes | None) else orjson.dumps(body)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.request(method, url, data=data, headers=hdrs, timeout=timeout) as resp:
        return resp.status, await resp.read()


async def get_json(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> Any:
    status, raw = await fetch(session, "GET", url, headers=headers, timeout_s=10)
    assert status == 200, f"GET {url} -> {status}: {raw[:300]!r}"
    return orjson.loads(raw)


async def scrape(session: aiohttp.ClientSession, url: str) -> Metrics:
    status, raw = await fetch(session, "GET", f"{url}/metrics", timeout_s=10)
    assert status == 200, f"GET {url}/metrics -> {status}"
    return parse_metrics(raw.decode())


async def wait_for(
    check: Callable[[], Awaitable[Any]], timeout_s: float, what: str, interval_s: float = 0.05
) -> Any:
    """Poll ``check`` until it returns a truthy value (returned); AssertionError past the deadline.

    Exceptions from ``check`` (a server not answering yet) count as "not yet".
    """
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = await check()
        except (OSError, AssertionError, TimeoutError) as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last: {last}")
        await asyncio.sleep(interval_s)  # poll with a deadline


async def idle_problems(
    session: Any, proc: Proc, role: str, headers: dict[str, str] | None = None
) -> list[str]:
    """What keeps a worker from being idle: queue gauges, room gauges, ages, pages, /debug."""
    m = await scrape(session, proc.url)
    problems = [f"{g}={m.get(g, role=role)}" for g in QUEUE_GAUGES if m.get(g, role=role) != 0]
    problems += [f"rooms[{s}]={n}" for s, n in m.by_label("pdserve_rooms", "state").items() if n]
    ages = m.by_label("pdserve_oldest_nonterminal_age_seconds", "state")
    problems += [f"oldest_age[{s}]={a}" for s, a in ages.items() if a != 0]
    total, free = m.get("pdserve_kv_pages_total", role=role), m.get("pdserve_kv_pages_free")
    cached = m.get("pdserve_kv_pages_cached", role=role)
    if total != free + cached:
        problems.append(f"pages free {free} + cached {cached} of {total}")
    for kind in ("rooms", "requests"):
        data = (await get_json(session, f"{proc.url}/debug/{kind}", headers))["data"]
        if data:
            problems.append(f"/debug/{kind}: {data}")
    return problems


async def wait_idle(
    session: aiohttp.ClientSession,
    proc: Proc,
    role: str,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> None:
    """Wait until ``proc`` shows exactly zero live work (see :func:`idle_problems`)."""

    async def is_idle() -> bool:
        problems = await idle_problems(session, proc, role, headers)
        assert not problems, f"{proc.name}: {problems}"
        return True

    await wait_for(is_idle, timeout_s, f"{proc.name} idle")


@dataclass
class StreamResult:
    """How one streamed completion ended, as the client saw it."""

    status: int | None = None
    num_tokens: int = 0  # text deltas received
    finish_reason: str | None = None
    error: Any = None  # an SSE error event, or the JSON error body of a non-200 answer
    saw_done: bool = False
    exception: str | None = None  # the connection broke (no [DONE])
    elapsed_s: float = 0.0

    @property
    def is_complete(self) -> bool:
        return self.status == 200 and self.finish_reason is not None and self.saw_done

    @property
    def is_clean_error(self) -> bool:
        """Ended with an error the client can read: an error status, or error event + [DONE]."""
        if self.status is not None and self.status >= 400:
            return self.error is not None
        return self.error is not None and self.saw_done


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    first_event: Any = None,
) -> StreamResult:
    """POST a streaming /v1/completions and read it to its end; never raises for server trouble.

    ``first_event`` (an asyncio.Event) is set once the first data event arrived.
    """
    res = StreamResult()
    started = time.monotonic()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        async with session.post(
            f"{url}/v1/completions",
            data=orjson.dumps({**body, "stream": True}),
            headers=hdrs,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = orjson.loads(await resp.read())
                return res
            async for raw_line in resp.content:
                _on_sse_line(res, raw_line.strip(), first_event)
    except (aiohttp.ClientError, TimeoutError) as exc:
        res.exception = f"{type(exc).__name__}: {exc}"
    finally:
        res.elapsed_s = time.monotonic() - started
    return res


def _on_sse_line(res: StreamResult, line: bytes, first_event: Any) -> None:
    if not line.startswith(b"data:"):
        return
    payload = line[5:].strip()
    if first_event is not None:
        first_event.set()
    if payload == b"[DONE]":
        res.saw_done = True
        return
    event = orjson.loads(payload)
    if "error" in event:
        res.error = event["error"]
        return
    for choice in event.get("choices", []):
        if choice.get("text"):
            res.num_tokens += 1
        res.finish_reason = choice.get("finish_reason") or res.finish_reason


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


PORT_FLAGS = ("--port", "--bootstrap-port")
