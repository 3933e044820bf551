"""The router's view of its workers: a registry (``WorkerManager``) of ``Worker`` objects and
the ``/server_info`` message they answer (the health checker, router/health.py, probes them).

Health state is written by the health checker (and by admin add/remove), and by the dispatcher
only to take out at once a worker that answered it is draining; breaker state and in-flight counts
only by the dispatcher; all on the event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pdserve.registration_msg import DeregistrationMsg, RegistrationMsg
from pdserve.router.breaker import CircuitBreaker
from pdserve.router.compat import Identity, incompatible
from pdserve.router.config import WORKER_ROLES, RouterConfig, normalize_worker_url
from pdserve.router.load import WorkerLoad, load_score

logger = logging.getLogger(__name__)

UNKNOWN = "unknown"
HEALTHY = "healthy"
UNHEALTHY = "unhealthy"


@dataclass(frozen=True, slots=True)
class ServerInfoMsg:
    """A worker's ``GET /server_info`` answer, validated."""

    role: str
    model: str
    engine_id: str
    incarnation: str
    bootstrap_port: int | None
    max_model_len: int
    dtype: str = ""  # KV dtype ("" from a worker that does not publish it)
    kv_layout: str = ""  # transport.layout.layout_fingerprint of its page pool
    weights: str = ""  # model.fingerprint.weights_fingerprint ("" if not published)
    load: WorkerLoad | None = None  # as of this probe; None from a worker that reports none

    @classmethod
    def from_json(cls, raw: Any) -> ServerInfoMsg:
        """Validate a decoded JSON value; ValueError says what is wrong."""
        if not isinstance(raw, dict):
            raise ValueError("server_info is not a JSON object")
        role = raw.get("role")
        if role not in WORKER_ROLES:
            raise ValueError(f"server_info.role invalid: {role!r}")
        port = raw.get("bootstrap_port")
        if port is not None and (type(port) is not int or not 0 < port < 65536):
            raise ValueError(f"server_info.bootstrap_port invalid: {port!r}")
        if role == "prefill" and port is None:
            raise ValueError("prefill server_info has no bootstrap_port")
        max_len = raw.get("max_model_len")
        if type(max_len) is not int or max_len <= 0:
            raise ValueError(f"server_info.max_model_len invalid: {max_len!r}")
        incarnation = raw.get("incarnation")
        if type(incarnation) not in (str, int) or incarnation == "":
            raise ValueError(f"server_info.incarnation invalid: {incarnation!r}")
        return cls(
            role=role,
            model=str(raw.get("model", "")),
            engine_id=str(raw.get("engine_id", "")),
            incarnation=str(incarnation),
            bootstrap_port=port,
            max_model_len=max_len,
            dtype=str(raw.get("dtype") or ""),
            kv_layout=str(raw.get("kv_layout") or ""),
            weights=str(raw.get("weights") or ""),
            load=WorkerLoad.from_json(raw.get("load")),
        )


@dataclass(eq=False)
class Worker:
    """One registered worker. Identity is the object: a removed and re-added URL is new."""

    url: str
    role: str
    breaker: CircuitBreaker
    state: str = UNKNOWN
    info: ServerInfoMsg | None = None
    num_in_flight: int = 0
    num_in_flight_tokens: int = 0  # prompt tokens of the legs in flight that prefill here
    last_error: str | None = None
    last_checked: float | None = None  # monotonic time of the last completed probe
    # Self-registered workers: the last registration and when its lease ends (monotonic);
    # None for workers given by flags or POST /workers, which never expire.
    registration: RegistrationMsg | None = None
    lease_expires_at: float | None = None
    incompatibility: str | None = None  # why it may not be paired (router/compat.py)
    # The bootstrap host of a prefill: its registration's, else its URL's host.
    host: str = field(init=False)

    def __post_init__(self) -> None:
        self.host = urlsplit(self.url).hostname or ""

    @property
    def is_healthy(self) -> bool:
        return self.state == HEALTHY

    @property
    def identity(self) -> Identity | None:
        """Model, dtype, KV layout and weights, from the last probe, else the registration."""
        src = self.info or self.registration
        if src is None:
            return None
        return Identity(src.model, src.dtype, src.kv_layout, src.weights)

    def is_available(self) -> bool:
        """Healthy, pairable with the fleet, and its breaker lets a request through."""
        return self.is_healthy and self.incompatibility is None and self.breaker.can_attempt()

    @property
    def load(self) -> WorkerLoad | None:
        """The load it reported at its last probe."""
        return self.info.load if self.info is not None else None

    def load_score(self) -> tuple[int, int]:
        """Lower is less loaded (router/load.py)."""
        return load_score(self.num_in_flight, self.load)

    def prefill_backlog(self) -> int:
        """Prompt tokens queued here for prefill: what it reported, or what this router sent
        it and has not heard the end of, when larger (current between two probes)."""
        load = self.load
        reported = load.waiting_prompt_tokens if load is not None else 0
        return max(reported, self.num_in_flight_tokens)

    def mark_draining(self) -> None:
        """It answered a request with ``draining``: out at once, not at the next probe (which
        puts it back once it is ready again, e.g. restarted)."""
        if self.state != UNHEALTHY:
            logger.info("worker %s: %s -> %s (draining)", self.url, self.state, UNHEALTHY)
        self.state = UNHEALTHY
        self.last_error = "draining"

    def to_json(self) -> dict[str, Any]:
        """The ``GET /workers`` entry."""
        info = self.info
        return {
            "url": self.url,
            "role": self.role,
            "state": self.state,
            "incarnation": info.incarnation if info else None,
            "engine_id": info.engine_id if info else None,
            "model": info.model if info else None,
            "bootstrap_port": info.bootstrap_port if info else None,
            "bootstrap_host": self.host if self.role == "prefill" else None,
            "dtype": info.dtype if info else None,
            "kv_layout": info.kv_layout if info else None,
            "weights": info.weights if info else None,
            "compatible": self.incompatibility is None,
            "compatibility_error": self.incompatibility,
            "registered": self.registration is not None,
            "in_flight": self.num_in_flight,
            "in_flight_prompt_tokens": self.num_in_flight_tokens,
            "breaker": self.breaker.state,
            "breaker_failures": self.breaker.num_failures,
            "last_error": self.last_error,
            "load": _load_json(self.load),
        }


def _load_json(load: WorkerLoad | None) -> dict[str, Any] | None:
    if load is None:
        return None
    return {
        "num_requests": load.num_requests,
        "queued": load.queued,
        "waiting_prompt_tokens": load.waiting_prompt_tokens,
        "running": load.running,
        "free_pages": load.free_pages,
        "draining": load.draining,
    }


class WorkerManager:
    """Owns the set of workers (add/remove at run time) and answers availability queries."""

    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._workers: dict[str, Worker] = {}  # insertion order = candidate order

    def add(self, url: str, role: str) -> Worker:
        """Register a worker (state unknown until its first probe). ValueError if invalid."""
        if role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {WORKER_ROLES}, got {role!r}")
        url = normalize_worker_url(url)
        if url in self._workers:
            raise ValueError(f"worker already registered: {url}")
        cfg = self._config
        breaker = CircuitBreaker(url, cfg.breaker_failures, cfg.breaker_reset_s, self._clock)
        worker = Worker(url=url, role=role, breaker=breaker)
        self._workers[url] = worker
        logger.info("worker %s added as %s", url, role)
        self.refresh_compatibility()
        return worker

    def register(self, msg: RegistrationMsg) -> tuple[Worker, bool]:
        """Add or renew a self-registered worker; (worker, is_new). ValueError on a role
        conflict with the worker already at that URL."""
        worker = self._workers.get(msg.url)
        is_new = worker is None
        if worker is None:
            worker = self.add(msg.url, msg.role)
        elif worker.role != msg.role:
            raise ValueError(f"{msg.url} is registered as {worker.role}, not {msg.role}")
        old = worker.registration
        if old is not None and old.incarnation != msg.incarnation:
            logger.info(
                "worker %s re-registered: incarnation %s -> %s",
                msg.url, old.incarnation, msg.incarnation,
            )  # fmt: skip
        worker.registration = msg
        if msg.bootstrap_host:
            worker.host = msg.bootstrap_host
        if is_new or worker.lease_expires_at is not None:  # a static worker never expires
            worker.lease_expires_at = self._clock() + msg.ttl_s
        self.refresh_compatibility()
        return worker, is_new

    def deregister(self, msg: DeregistrationMsg) -> Worker | None:
        """Remove a self-registered worker leaving on purpose (drain, stop). A static worker,
        or a message from another incarnation than the registered one, is left alone."""
        worker = self._workers.get(msg.url)
        reg = worker.registration if worker is not None else None
        if worker is None or worker.lease_expires_at is None or reg is None:
            return None
        if reg.incarnation != msg.incarnation:
            logger.info(
                "worker %s: ignoring deregistration of incarnation %s (registered: %s)",
                msg.url, msg.incarnation, reg.incarnation,
            )  # fmt: skip
            return None
        logger.info("worker %s (%s) deregistered", msg.url, worker.role)
        return self.remove(msg.url)

    def expire(self) -> list[Worker]:
        """Forget self-registered workers whose lease ended; they come back when they renew."""
        now = self._clock()
        gone = [
            w
            for w in self._workers.values()
            if w.lease_expires_at is not None and w.lease_expires_at <= now
        ]
        for w in gone:
            logger.warning(
                "worker %s (%s): lease expired %.1fs ago, forgotten",
                w.url, w.role, now - (w.lease_expires_at or now),
            )  # fmt: skip
            self.remove(w.url)
        return gone

    def refresh_compatibility(self) -> None:
        """Recompute which prefill/decode workers may be paired; logs every change."""
        reasons = incompatible(list(self._workers.values()))
        for w in self._workers.values():
            reason = reasons.get(w.url)
            if reason != w.incompatibility:
                if reason is None:
                    logger.info("worker %s (%s) is compatible again", w.url, w.role)
                else:
                    logger.error("worker %s (%s) not paired: %s", w.url, w.role, reason)
                w.incompatibility = reason

    def remove(self, url: str) -> Worker | None:
        """Unregister; requests already on it finish. None if it was not registered."""
        try:
            url = normalize_worker_url(url)
        except ValueError:
            return None
        worker = self._workers.pop(url, None)
        if worker is not None:
            logger.info("worker %s (%s) removed", url, worker.role)
            self.refresh_compatibility()
        return worker

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def is_registered(self, worker: Worker) -> bool:
        return self._workers.get(worker.url) is worker

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def available(self, role: str) -> list[Worker]:
        """Workers of ``role`` that may take a request now, in registration order."""
        return [w for w in self._workers.values() if w.role == role and w.is_available()]

    def has_complete_path(self) -> bool:
        """The full path is up: a prefill+decode pair or a colocated worker can take a request
        now (``GET /health/pd``)."""
        if self.available("colocated"):
            return True
        return bool(self.available("prefill")) and bool(self.available("decode"))

    def has_serving_path(self) -> bool:
        """Some path serves a request now: the full one, or a decode that prefills itself
        (the fallback when no prefill is available, unless ``enforce_disagg``)."""
        if self.has_complete_path():
            return True
        return not self._config.enforce_disagg and bool(self.available("decode"))
