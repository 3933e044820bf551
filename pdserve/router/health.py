"""The router's health checker: probes every worker (``/health/ready`` + ``/server_info``) each
``--health-interval``, and applies the result to the registry (router/workers.py): takes
unhealthy workers out, puts them back, notices restarts and records their load."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from pdserve.router.config import RouterConfig
from pdserve.router.workers import HEALTHY, UNHEALTHY, ServerInfoMsg, Worker, WorkerManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    is_ready: bool
    info: ServerInfoMsg | None
    error: str | None


class HealthChecker:
    """Periodically probes every worker (``/health/ready`` + ``/server_info``) and applies the
    result: takes unhealthy workers out, puts them back, and notices restarts."""

    def __init__(
        self, config: RouterConfig, workers: WorkerManager, session: aiohttp.ClientSession
    ) -> None:
        self._config = config
        self._workers = workers
        self._session = session
        self._headers = (
            {"Authorization": f"Bearer {config.worker_api_key}"} if config.worker_api_key else {}
        )
        self._timeout = aiohttp.ClientTimeout(
            total=config.health_timeout_s, sock_connect=config.connect_timeout_s
        )
        self.num_rounds = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Probe all workers every ``health_interval_s`` until ``stop`` is set."""
        while not stop.is_set():
            await self.check_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self._config.health_interval_s)

    async def check_all(self) -> None:
        """One probe round over every registered worker, concurrently."""
        self._workers.expire()
        workers = self._workers.all()
        await asyncio.gather(*(self.check(w) for w in workers))
        self._workers.refresh_compatibility()
        self.num_rounds += 1

    async def check(self, worker: Worker) -> None:
        """Probe one worker and apply the result (if it is still registered)."""
        result = await self.probe(worker.url)
        if self._workers.is_registered(worker):
            apply_probe(worker, result, time.monotonic())
            self._workers.refresh_compatibility()

    async def probe(self, url: str) -> ProbeResult:
        """``GET /health/ready`` and ``/server_info`` of one URL, bounded by health_timeout_s."""
        try:
            ready_status, info_raw = await asyncio.gather(
                self._get_status(f"{url}/health/ready"), self._get_json(f"{url}/server_info")
            )
            info = ServerInfoMsg.from_json(info_raw)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return ProbeResult(False, None, f"{type(exc).__name__}: {exc}"[:300])
        if ready_status != 200:
            return ProbeResult(False, info, f"/health/ready answered {ready_status}")
        return ProbeResult(True, info, None)

    # allow_redirects=False: a worker URL passed --worker-allow; where it redirects has not.
    async def _get_status(self, url: str) -> int:
        async with self._session.get(
            url, timeout=self._timeout, headers=self._headers, allow_redirects=False
        ) as resp:
            await resp.read()
            return resp.status

    async def _get_json(self, url: str) -> Any:
        async with self._session.get(
            url, timeout=self._timeout, headers=self._headers, allow_redirects=False
        ) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise ValueError(f"/server_info answered {resp.status}")
            return orjson.loads(body)


def apply_probe(worker: Worker, result: ProbeResult, now: float) -> None:
    """Update one worker from a probe; logs every state change with its reason."""
    worker.last_checked = now
    info = result.info
    if info is not None and info.role != worker.role:
        result = ProbeResult(
            False, info, f"role mismatch: registered {worker.role}, is {info.role}"
        )
    if info is not None:
        old = worker.info
        if old is not None and old.incarnation != info.incarnation:
            logger.info(
                "worker %s restarted: incarnation %s -> %s, bootstrap_port %s -> %s",
                worker.url,
                old.incarnation,
                info.incarnation,
                old.bootstrap_port,
                info.bootstrap_port,
            )
            worker.breaker.reset("new incarnation")
        worker.info = info
    new_state = HEALTHY if result.is_ready else UNHEALTHY
    if new_state != worker.state:
        # Losing a worker that served is worth a warning; one not up yet (startup) is not.
        log = logger.warning if worker.state == HEALTHY else logger.info
        log(
            "worker %s: %s -> %s (%s)", worker.url, worker.state, new_state, result.error or "ready"
        )
    worker.state = new_state
    worker.last_error = result.error
