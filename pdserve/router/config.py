"""Router configuration: one frozen dataclass, validated once, passed down explicitly."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.auth import Credentials, as_keys

# The worker-side contract lives below the router; re-exported for the router's modules.
from pdserve.registration_msg import WORKER_ROLES as WORKER_ROLES
from pdserve.registration_msg import normalize_worker_url as normalize_worker_url
from pdserve.router.worker_allow import WorkerAllowList
from pdserve.tls import TLSConfig

POLICY_NAMES = ("auto", "round_robin", "random", "power_of_two", "least_loaded", "cache_aware")
# What the router's GET /health/ready requires: "serving", any path that serves (the decode
# fallback included, so a balancer keeps a router that lost every prefill in rotation); "pd",
# the full path (a prefill+decode pair or a colocated worker; always at GET /health/pd).
READINESS_MODES = ("serving", "pd")


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs; see ``pdserve router --help`` for the CLI names.

    ``first_byte_timeout_s`` bounds the wait for the decode (or colocated) leg's first event;
    when it fires the attempt is retried elsewhere. ``None`` means ``request_timeout_s``.
    ``worker_api_key`` is sent as a Bearer token on every call to a worker (requests, health
    checks, aborts of its own requests): the workers' client key, never their admin key.
    ``api_key`` (one or a tuple), ``admin_api_key`` and ``registration_token`` are what the
    router's clients, operators and self-registering workers present (pdserve/auth.py).
    """

    host: str = "127.0.0.1"
    port: int = 30000
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    worker_urls: tuple[str, ...] = ()  # colocated workers: plain load balancing
    # auto: cache_aware while more than one prefill is available, else round_robin (policies.py)
    policy: str = "auto"
    # cache_aware: prefix match fraction that wins, and the load gap (in-flight, absolute and
    # ratio) past which the least loaded worker wins instead (pdserve.router.cache_aware).
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 16
    balance_rel_threshold: float = 1.5
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float | None = None
    abort_timeout_s: float = 2.0
    max_attempts: int = 3
    migration_limit: int = 3  # resumptions of a stream broken mid-answer; 0 turns it off
    enforce_disagg: bool = False  # no decode-prefills-itself fallback without a prefill
    readiness: str = "serving"  # what GET /health/ready requires (READINESS_MODES)
    backoff_base_s: float = 0.05
    max_backoff_s: float = 2.0
    breaker_failures: int = 3
    breaker_reset_s: float = 5.0
    # Access (pdserve/auth.py): clients' key(s), the control plane's, and registration's.
    api_key: str | tuple[str, ...] | None = None
    admin_api_key: str | None = None
    registration_token: str | None = None
    metrics_open: bool = False  # /metrics without the admin key
    worker_api_key: str | None = None  # the workers' client key: all the router needs of them
    # --worker-allow: CIDRs / host names a registered or added worker URL may name; empty:
    # loopback and this machine's networks (router/worker_allow.py).
    worker_allow: tuple[str, ...] = ()
    # The model a registered or added worker must serve; None: what the healthy fleet serves.
    served_model_name: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    # Admission (router/load.py): a worker with this many requests queued cannot take more soon.
    max_worker_queue: int = 256
    # ... and a prefilling worker with this many prompt tokens queued takes no more prompts.
    max_prefill_backlog_tokens: int = 65536
    retry_after_s: int = 1  # the Retry-After of a 429 (admission check) or 503 (draining)
    drain_timeout_s: float = 30.0  # SIGTERM: requests in flight get this long to finish
    # --ssl-*: the router serves HTTPS; its calls to https workers verify against ca_certs.
    tls: TLSConfig = field(default_factory=TLSConfig)
    # A stream with no data chunk yet gets ": keep-alive" comments this often (0: off).
    sse_keepalive_s: float = 15.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "worker_allow", tuple(self.worker_allow))
        if self.worker_allow:
            WorkerAllowList.parse(self.worker_allow)  # ValueError names a bad entry
        self.credentials  # noqa: B018 -- ValueError if two roles share a secret
        for name in ("prefill_urls", "decode_urls", "worker_urls"):
            urls = tuple(normalize_worker_url(u) for u in getattr(self, name))
            object.__setattr__(self, name, urls)
        all_urls = self.prefill_urls + self.decode_urls + self.worker_urls
        if len(set(all_urls)) != len(all_urls):
            raise ValueError("a worker url is listed more than once")
        if self.readiness not in READINESS_MODES:
            raise ValueError(f"readiness must be one of {READINESS_MODES}: {self.readiness!r}")
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {POLICY_NAMES}, got {self.policy!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        if self.max_attempts < 1 or self.breaker_failures < 1:
            raise ValueError("max_attempts and breaker_failures must be >= 1")
        if self.max_worker_queue < 1 or self.retry_after_s < 0:
            raise ValueError("max_worker_queue must be >= 1 and retry_after_s >= 0")
        if self.max_prefill_backlog_tokens < 1:
            raise ValueError("max_prefill_backlog_tokens must be >= 1")
        if self.migration_limit < 0:
            raise ValueError("migration_limit must be >= 0")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        for name in (
            "health_interval_s",
            "health_timeout_s",
            "request_timeout_s",
            "connect_timeout_s",
            "abort_timeout_s",
            "breaker_reset_s",
            "drain_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.first_byte_timeout_s is not None and not self.first_byte_timeout_s > 0:
            raise ValueError("first_byte_timeout_s must be > 0 or None")
        if self.sse_keepalive_s < 0:
            raise ValueError("sse_keepalive_s must be >= 0 (0: off)")
        if self.backoff_base_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff times must be >= 0")

    @property
    def credentials(self) -> Credentials:
        """What the router's own listener checks (pdserve/auth.py)."""
        return Credentials(
            as_keys(self.api_key), self.admin_api_key, self.registration_token, self.metrics_open
        )

    @property
    def effective_first_byte_timeout_s(self) -> float:
        """The first-byte deadline actually applied (never beyond request_timeout_s)."""
        if self.first_byte_timeout_s is None:
            return self.request_timeout_s
        return min(self.first_byte_timeout_s, self.request_timeout_s)
