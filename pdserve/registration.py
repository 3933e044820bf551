"""A worker announcing itself to routers (``pdserve serve --router URL``, repeatable).

Each router gets its own loop: register, then renew every ``interval_s`` (the router forgets
the worker ``ttl_s`` after the last renewal it received). A router that is down or slow never
blocks the worker: every request is bounded by ``timeout_s`` and failures are retried with
exponential backoff (logged once when they start and once when they stop).
:meth:`Registration.deregister` (called on drain and stop) ends the loops and tells every
router the worker is leaving, so none routes a new request to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import aiohttp

from pdserve.registration_msg import (
    MIN_TTL_S,
    DeregistrationMsg,
    RegistrationMsg,
    normalize_worker_url,
)
from pdserve.tls import TLSConfig

logger = logging.getLogger(__name__)

_FIRST_BACKOFF_S = 0.1


@dataclass(frozen=True)
class RegistrationConfig:
    """Where and how often to register. ``token`` is the routers' ``--registration-token``,
    if they have one (the only credential a registration carries: not the worker's keys)."""

    router_urls: tuple[str, ...]
    interval_s: float = 2.0
    ttl_s: float = 6.0
    timeout_s: float = 2.0
    token: str | None = None
    tls: TLSConfig = field(default_factory=TLSConfig)  # an https router verified against ca_certs

    def __post_init__(self) -> None:
        if not self.router_urls:
            raise ValueError("registration needs at least one --router URL")
        urls = tuple(normalize_worker_url(u) for u in self.router_urls)
        if len(set(urls)) != len(urls):
            raise ValueError("a --router URL is given more than once")
        object.__setattr__(self, "router_urls", urls)
        if not self.interval_s > 0 or not self.timeout_s > 0:
            raise ValueError("--register-interval and the registration timeout must be > 0")
        if not self.ttl_s > self.interval_s or self.ttl_s < MIN_TTL_S:
            raise ValueError(
                f"--register-ttl ({self.ttl_s}) must exceed --register-interval "
                f"({self.interval_s}) and be >= {MIN_TTL_S}: else a lease lapses between renewals"
            )


class Registration:
    """Keeps one worker registered with every configured router until :meth:`deregister`."""

    def __init__(self, config: RegistrationConfig, msg: RegistrationMsg) -> None:
        self.config = config
        self.msg = msg
        self._headers = {"Authorization": f"Bearer {config.token}"} if config.token else {}
        self._timeout = aiohttp.ClientTimeout(total=config.timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.num_renewals = 0  # successful registrations and renewals, all routers
        self._is_registered: dict[str, asyncio.Event] = {}

    def start(self) -> None:
        """Start one register-and-renew loop per router (returns at once)."""
        connector = aiohttp.TCPConnector(ssl=self.config.tls.client_context())
        self._session = aiohttp.ClientSession(connector=connector)
        for url in self.config.router_urls:
            self._is_registered[url] = asyncio.Event()
            self._tasks.append(asyncio.create_task(self._keep(url), name=f"register-{url}"))

    async def wait_registered(self, timeout_s: float) -> bool:
        """True once every router accepted a registration (tests, start-up logs)."""
        waits = [e.wait() for e in self._is_registered.values()]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), timeout_s)
        except TimeoutError:
            return False
        return True

    async def deregister(self) -> None:
        """Stop renewing and tell every router this worker leaves (idempotent, bounded by
        ``timeout_s``). A router that does not hear it forgets the worker when the lease ends."""
        if self._session is None:
            return
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        body = DeregistrationMsg(self.msg.url, self.msg.incarnation).to_json()
        await asyncio.gather(
            *(self._post(url, "/workers/deregister", body) for url in self.config.router_urls)
        )
        await self._session.close()
        self._session = None
        logger.info(
            "worker %s deregistered from %s", self.msg.url, ", ".join(self.config.router_urls)
        )

    async def _keep(self, router: str) -> None:
        backoff = _FIRST_BACKOFF_S
        failing = False
        while not self._stop.is_set():
            error = await self._post(router, "/workers/register", self.msg.to_json())
            if error is None:
                self.num_renewals += 1
                self._is_registered[router].set()
                if failing:
                    logger.info("registered with router %s again", router)
                failing, backoff, wait = False, _FIRST_BACKOFF_S, self.config.interval_s
            else:
                if not failing:
                    logger.warning(
                        "cannot register with router %s (%s): retrying with backoff", router, error
                    )
                else:
                    logger.debug("router %s still unreachable: %s", router, error)
                failing, wait = True, backoff
                backoff = min(backoff * 2, self.config.interval_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=wait)

    async def _post(self, router: str, path: str, body: dict[str, object]) -> str | None:
        """POST one message; None on success, else why not (never raises)."""
        assert self._session is not None
        try:
            async with self._session.post(
                router + path, json=body, headers=self._headers, timeout=self._timeout
            ) as resp:
                raw = await resp.read()
                if resp.status >= 300:
                    return f"{resp.status}: {raw[:300].decode('utf-8', 'replace')}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None
