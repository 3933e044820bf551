"""A local PD cluster of real ``pdserve`` processes for the chaos benches (abort_storm, chaos).

Each process keeps its ports for life, so a SIGKILLed one can be restarted where the router (and
the decode workers' kv_transfer_params) expect it; its log file is appended across restarts, so the
Traceback check covers every life. Readiness is polled with deadlines; nothing sleeps to
synchronise. :func:`check_idle` reads what every worker says about itself (queue gauges, KV pages,
``/debug/rooms``, ``/debug/requests``) and the router's ``/debug/requests``.

    async with Cluster(ClusterSpec(model_dir=...)) as cluster:
        ...  # cluster.router.url, cluster.decodes[0].kill(), await cluster.restart(proc)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from bench.tls_certs import CertFiles

QUEUE_GAUGES = (
    "pdserve_waiting_requests",
    "pdserve_running_requests",
    "pdserve_prefill_inflight_requests",
    "pdserve_decode_waiting_for_kv_requests",
)
# Short deadlines so every failure mode resolves in seconds (the defaults are tens of seconds).
DEFAULT_WORKER_ARGS = (
    "--kv-cache-mb", "64", "--num-threads", "1", "--heartbeat-interval", "0.5",
    "--timeout-bootstrap", "5", "--timeout-waiting-for-input", "15", "--timeout-transfer", "5",
    "--timeout-queue", "30", "--timeout-waiting-for-kv", "20", "--timeout-request", "40",
)  # fmt: skip
DEFAULT_ROUTER_ARGS = (
    "--policy", "round_robin",  # the chaos benches kill one worker of a role: load on each
    "--health-interval", "0.5", "--health-timeout", "1", "--request-timeout", "45",
    "--first-byte-timeout", "25", "--breaker-reset", "2",
)  # fmt: skip
PROBE_TIMEOUT_S = 5.0  # one HTTP call to a local process
# A router's /health/ready also counts a decode prefilling itself; a bench measures the PD path.
ROUTER_READY_PATH = "/health/pd"


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ClusterSpec:
    """What to start: the demo (or any) model, worker counts, flags, per-role fault plans."""

    model_dir: str
    served_model_name: str = "demo"
    num_prefill: int = 1
    num_decode: int = 1
    worker_args: tuple[str, ...] = DEFAULT_WORKER_ARGS
    prefill_args: tuple[str, ...] = ()  # after worker_args, per role (e.g. "-tp", "2")
    decode_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = DEFAULT_ROUTER_ARGS
    log_dir: str | None = None  # a fresh temp dir when None
    log_level: str = "INFO"
    max_ready_s: float = 240.0
    # Secured: every process serves HTTPS with these files (``bench/tls_certs.py``), the router
    # calls the workers over it, and clients and the router present ``api_key``.
    tls: CertFiles | None = None
    api_key: str | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def secure_args(self) -> tuple[str, ...]:
        """The TLS and key flags of every process (the router's key is also its workers')."""
        out: tuple[str, ...] = ()
        if self.tls:
            out += ("--ssl-certfile", str(self.tls.cert), "--ssl-keyfile", str(self.tls.key),
                    "--ssl-ca-certs", str(self.tls.ca))  # fmt: skip
        return out + (("--api-key", self.api_key) if self.api_key else ())


PDSERVE = (sys.executable, "-m", "pdserve")


@dataclass
class ManagedProc:
    """One server child (``python -m pdserve ...`` unless ``command`` says otherwise) with fixed
    ports, restartable with other flags."""

    name: str
    role: str  # prefill | decode | router | colocated | vllm
    argv: list[str]
    url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    command: tuple[str, ...] = PDSERVE
    ready_path: str = "/health/ready"  # answers 200 once the server serves
    popen: subprocess.Popen[bytes] | None = None
    num_starts: int = 0
    num_kills: int = 0

    @property
    def is_running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> None:
        """Spawn the process (its own session, so a kill takes its whole group)."""
        self.num_starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== bench: start #{self.num_starts} of {self.name} ===\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                [*self.command, *self.argv, *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **self.env},
            )  # fmt: skip

    def kill(self) -> None:
        """SIGKILL, no goodbye to any peer; returns once the process is reaped."""
        if self.is_running:
            assert self.popen is not None
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=30)
            self.num_kills += 1

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM with a grace period, then SIGKILL."""
        if not self.is_running:
            return
        assert self.popen is not None
        os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    async def wait_ready(self, session: aiohttp.ClientSession, max_wait_s: float) -> None:
        """Poll ``ready_path`` until 200; fail fast if the process exits."""
        deadline = time.monotonic() + max_wait_s
        delay = 0.05
        while True:
            if not self.is_running:
                code = self.popen.returncode if self.popen else None
                raise RuntimeError(f"{self.name} exited ({code}); log {self.log_path}")
            if await is_ready(session, self.url, self.ready_path):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready in {max_wait_s:g}s; log {self.log_path}")
            await asyncio.sleep(delay)  # readiness poll interval, bounded by the deadline
            delay = min(delay * 2, 0.5)


async def is_ready(session: aiohttp.ClientSession, url: str, path: str = "/health/ready") -> bool:
    try:
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        async with session.get(f"{url}{path}", timeout=timeout) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


class ReferenceServer:
    """A reference server (vLLM, llama.cpp) run as one ManagedProc: its URL, ``async with``
    starting it and waiting until it is ready (stopping it if that fails), and a stop of its
    whole process group on exit. Subclasses set ``port``, ``proc`` and ``ready_timeout_s``."""

    port: int
    proc: ManagedProc
    ready_timeout_s: ClassVar[float]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def popen(self) -> subprocess.Popen[bytes] | None:
        return self.proc.popen

    async def __aenter__(self) -> Self:
        await asyncio.to_thread(self.proc.start)
        try:
            async with aiohttp.ClientSession() as session:
                await self.proc.wait_ready(session, self.ready_timeout_s)
        except BaseException:
            await asyncio.to_thread(self.proc.stop)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.proc.stop, 30.0)


class Cluster:
    """Prefill + decode workers and a router on free 127.0.0.1 ports, with their logs."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.log_dir = Path(spec.log_dir or tempfile.mkdtemp(prefix="pdserve-chaos-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.prefills = [self._worker(f"prefill-{i}", "prefill") for i in range(spec.num_prefill)]
        self.decodes = [self._worker(f"decode-{i}", "decode") for i in range(spec.num_decode)]
        self.router = self._router()
        self._session: aiohttp.ClientSession | None = None

    @property
    def workers(self) -> list[ManagedProc]:
        return [*self.prefills, *self.decodes]

    @property
    def procs(self) -> list[ManagedProc]:
        return [*self.workers, self.router]

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "cluster not started"
        return self._session

    def _worker(self, name: str, role: str) -> ManagedProc:
        port = free_port()
        argv = ["serve", "--role", role, "--model", self.spec.model_dir, "--port", str(port),
                "--served-model-name", self.spec.served_model_name, "--engine-id", name,
                *self.spec.worker_args, *self.spec.secure_args()]  # fmt: skip
        argv += self.spec.prefill_args if role == "prefill" else self.spec.decode_args
        if role == "prefill":
            argv += ["--bootstrap-port", str(free_port())]
        return ManagedProc(name, role, argv, f"{self.spec.scheme}://127.0.0.1:{port}",
                           self.log_dir / f"{name}.log", self._env())  # fmt: skip

    def _router(self) -> ManagedProc:
        port = free_port()
        argv = ["router", "--port", str(port), *self.spec.router_args, *self.spec.secure_args()]
        for p in self.prefills:
            argv += ["--prefill", p.url]
        for d in self.decodes:
            argv += ["--decode", d.url]
        return ManagedProc("router", "router", argv, f"{self.spec.scheme}://127.0.0.1:{port}",
                           self.log_dir / "router.log", self._env(),
                           ready_path=ROUTER_READY_PATH)  # fmt: skip

    def _env(self) -> dict[str, str]:
        return {"PDSERVE_LOG_LEVEL": self.spec.log_level}

    def _connector(self) -> aiohttp.TCPConnector:
        """The bench's HTTP connections (a subclass may open them from elsewhere)."""
        tls = self.spec.tls
        ctx = ssl.create_default_context(cafile=str(tls.ca)) if tls else True
        return aiohttp.TCPConnector(force_close=True, ssl=ctx)

    def _headers(self) -> dict[str, str]:
        """Headers of every bench call: a secured cluster's client key (a subclass off loopback
        sends its admin key instead)."""
        key = self.spec.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def __aenter__(self) -> Cluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start every process at once (any order works) and wait until all are ready and the
        router lists every worker healthy: it is ready once one pair is, and a bench that kills
        or compares workers must not start while the others are still unseen."""
        self._session = aiohttp.ClientSession(connector=self._connector(), headers=self._headers())
        try:
            for proc in self.procs:
                proc.start()
            await self.wait_ready(self.procs)
            await self.wait_router_sees_all(self.spec.max_ready_s)
        except BaseException:
            await self.stop()
            raise

    async def wait_ready(self, procs: list[ManagedProc]) -> None:
        coros = [p.wait_ready(self.session, self.spec.max_ready_s) for p in procs]
        await asyncio.gather(*coros)

    async def restart(self, proc: ManagedProc, extra_args: tuple[str, ...] | None = None) -> None:
        """Stop ``proc`` if it runs (SIGTERM), start it again (optionally with other extra
        flags, e.g. a fault plan) on the same ports, and wait until it is ready."""
        await asyncio.to_thread(proc.stop)
        if extra_args is not None:
            proc.extra_args = extra_args
        proc.start()
        await proc.wait_ready(self.session, self.spec.max_ready_s)

    async def wait_router_sees_all(self, max_wait_s: float = 30.0) -> None:
        """Poll until the router lists every worker healthy with its current incarnation (a
        restarted worker rejoins by itself: nothing here tells the router anything)."""
        deadline = time.monotonic() + max_wait_s
        while not await self._router_sees_all():
            if time.monotonic() > deadline:
                raise TimeoutError(f"router does not see all workers healthy in {max_wait_s:g}s")
            await asyncio.sleep(0.1)  # poll interval, bounded by the deadline

    async def _router_sees_all(self) -> bool:
        try:
            listed = (await get_json(self.session, f"{self.router.url}/workers"))["data"]
            seen = {w["url"]: w for w in listed if w["state"] == "healthy"}
            for proc in self.workers:
                info = await get_json(self.session, f"{proc.url}/server_info")
                if seen.get(proc.url, {}).get("incarnation") != info["incarnation"]:
                    return False
            return True
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
            return False

    async def stop(self) -> None:
        """SIGTERM everything (router first), then close the HTTP session."""
        await asyncio.to_thread(lambda: [p.stop() for p in reversed(self.procs)])
        if self._session is not None:
            await self._session.close()
            self._session = None

    def target(self) -> Target:
        """The router, the workers and the logs of this cluster, for the invariant checks."""
        workers = {p.name: p.url for p in self.workers}
        return Target(self.router.url, workers, tuple(p.log_path for p in self.procs))


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    async with session.get(url, timeout=timeout) as resp:
        resp.raise_for_status()
        return json.loads(await resp.read())


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """``/metrics`` as ``{sample name: value summed over label sets}``."""
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    async with session.get(f"{url}/metrics", timeout=timeout) as resp:
        resp.raise_for_status()
        text = (await resp.read()).decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


@dataclass(frozen=True)
class Target:
    """Where the invariants are checked: the router and every worker (name -> URL), and the
    log files to search for tracebacks. A :class:`Cluster` gives one; so can the command line."""

    router_url: str
    worker_urls: dict[str, str]
    log_paths: tuple[Path, ...] = ()


@dataclass
class WorkerIdleState:
    """What one worker reports about its queues, pages and live rooms/requests."""

    name: str
    queues: dict[str, float] = field(default_factory=dict)
    pages_free: float = -1.0  # free or cached (unreferenced): idle, it equals the total
    pages_total: float = -2.0
    num_debug_rooms: int = -1
    num_debug_requests: int = -1
    error: str | None = None  # the worker could not be asked

    @property
    def is_idle(self) -> bool:
        return (
            self.error is None
            and all(v == 0 for v in self.queues.values())
            and self.pages_free == self.pages_total
            and self.num_debug_rooms == 0
            and self.num_debug_requests == 0
        )


async def worker_idle_state(session: aiohttp.ClientSession, name: str, url: str) -> WorkerIdleState:
    """Queue gauges, KV pages and ``/debug`` listings of one worker, or why it did not answer."""
    state = WorkerIdleState(name)
    try:
        m = await scrape(session, url)
        state.queues = {g: m.get(g, float("nan")) for g in QUEUE_GAUGES}
        state.pages_free = m["pdserve_kv_pages_free"] + m.get("pdserve_kv_pages_cached", 0.0)
        state.pages_total = m["pdserve_kv_pages_total"]
        state.num_debug_rooms = len((await get_json(session, f"{url}/debug/rooms"))["data"])
        state.num_debug_requests = len((await get_json(session, f"{url}/debug/requests"))["data"])
    except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as e:
        state.error = f"{type(e).__name__}: {e}"
    return state


@dataclass
class IdleReport:
    """Every worker's idle state and the router's live requests, after the wait."""

    workers: list[WorkerIdleState]
    num_router_requests: int  # -1: the router did not answer
    waited_s: float

    @property
    def is_idle(self) -> bool:
        return self.num_router_requests == 0 and all(w.is_idle for w in self.workers)


async def check_idle(
    session: aiohttp.ClientSession, target: Target, max_wait_s: float = 30.0
) -> IdleReport:
    """Poll until every worker and the router are idle, or ``max_wait_s`` passes; the last
    observation either way. Aborts, fences and peer-loss detection settle asynchronously,
    hence a bounded wait rather than one look."""
    started = time.monotonic()
    while True:
        states = [
            await worker_idle_state(session, name, url) for name, url in target.worker_urls.items()
        ]
        try:
            data = await get_json(session, f"{target.router_url}/debug/requests")
            num_router = len(data["data"])
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
            num_router = -1
        report = IdleReport(states, num_router, time.monotonic() - started)
        if report.is_idle or report.waited_s > max_wait_s:
            return report
        await asyncio.sleep(0.1)  # poll interval, bounded by max_wait_s


def count_tracebacks(log_paths: tuple[Path, ...]) -> dict[str, int]:
    """'Traceback' occurrences per log file (an invariant: all zero)."""
    counts = {}
    for path in log_paths:
        text = path.read_text(errors="replace") if path.exists() else ""
        counts[path.name] = text.count("Traceback")
    return counts
