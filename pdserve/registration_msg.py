"""The registration message a worker sends to routers (``POST /workers/register``) and its
lease: a router keeps a self-registered worker only while its renewals keep coming.

The contract between a worker (:mod:`pdserve.registration`) and the router (``router/``): it
sits below both, so a worker never imports the router.

Routers hold only soft state: everything a router knows of a self-registered worker arrives
again with each renewal, so a restarted router, or a second one behind the same address,
learns the whole fleet within one renewal interval.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

WORKER_ROLES = ("prefill", "decode", "colocated")


def normalize_worker_url(url: str) -> str:
    """Canonical form of a worker base URL (``http://host:port``, no trailing slash).

    Raises ``ValueError`` for anything that is not a plain http(s) URL with a host and a port,
    because the router derives the prefill bootstrap host from it.
    """
    if not isinstance(url, str) or not url:
        raise ValueError("worker url must be a non-empty string")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker url must be http(s)://host:port, got {url!r}")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"worker url has an invalid port: {url!r}") from exc
    if port is None:
        raise ValueError(f"worker url needs an explicit port: {url!r}")
    if parts.query or parts.fragment or parts.path not in ("", "/"):
        raise ValueError(f"worker url must be a base URL without path or query: {url!r}")
    return f"{parts.scheme}://{parts.netloc}"


MIN_TTL_S = 0.2
MAX_TTL_S = 3600.0
_MAX_FIELD_LEN = 256


@dataclass(frozen=True, slots=True)
class RegistrationMsg:
    """One worker's registration (also each renewal). ``url`` is the worker's advertised base
    URL; ``bootstrap_host``/``bootstrap_port`` the prefill's KV bootstrap address (None on
    other roles); ``kv_layout`` is ``transport.layout.layout_fingerprint`` of its page pool,
    ``weights`` ``model.fingerprint.weights_fingerprint`` of its checkpoint."""

    url: str
    role: str
    model: str
    dtype: str
    kv_layout: str
    engine_id: str
    incarnation: str
    ttl_s: float
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    weights: str = ""  # "" from a worker that does not publish it: matches any

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> RegistrationMsg:
        """Validate a decoded JSON body; ValueError names the bad field."""
        if not isinstance(raw, dict):
            raise ValueError("registration must be a JSON object")
        url = _url(raw)
        role = raw.get("role")
        if role not in WORKER_ROLES:
            raise ValueError(f"role must be one of {WORKER_ROLES}, got {role!r}")
        ttl = raw.get("ttl_s")
        if type(ttl) not in (int, float) or not MIN_TTL_S <= ttl <= MAX_TTL_S:
            raise ValueError(f"ttl_s must be a number in [{MIN_TTL_S}, {MAX_TTL_S}], got {ttl!r}")
        host = raw.get("bootstrap_host")
        port = raw.get("bootstrap_port")
        if host is not None and (not isinstance(host, str) or not 0 < len(host) <= 255):
            raise ValueError(f"bootstrap_host invalid: {host!r}")
        if port is not None and (type(port) is not int or not 0 < port < 65536):
            raise ValueError(f"bootstrap_port invalid: {port!r}")
        if role == "prefill" and port is None:
            raise ValueError("a prefill registration needs bootstrap_port")
        return cls(
            url=url,
            role=role,
            model=_text(raw, "model"),
            dtype=_text(raw, "dtype", empty_ok=True),
            kv_layout=_text(raw, "kv_layout", empty_ok=True),
            engine_id=_text(raw, "engine_id"),
            incarnation=_text(raw, "incarnation"),
            ttl_s=float(ttl),
            bootstrap_host=host,
            bootstrap_port=port,
            weights=_text(raw, "weights", empty_ok=True) if "weights" in raw else "",
        )


def _url(raw: dict[str, Any]) -> str:
    try:
        return normalize_worker_url(_text(raw, "url"))
    except ValueError as exc:
        raise ValueError(f"url invalid: {exc}") from None


def _text(raw: dict[str, Any], name: str, *, empty_ok: bool = False) -> str:
    value = raw.get(name)
    if not isinstance(value, str) or len(value) > _MAX_FIELD_LEN or (not value and not empty_ok):
        raise ValueError(f"{name} must be a string of 1..{_MAX_FIELD_LEN} characters")
    return value


@dataclass(frozen=True, slots=True)
class DeregistrationMsg:
    """``POST /workers/deregister``: a draining or stopping worker leaves. ``incarnation``
    guards against a late message of a previous life removing its successor."""

    url: str
    incarnation: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> DeregistrationMsg:
        if not isinstance(raw, dict):
            raise ValueError("deregistration must be a JSON object")
        return cls(url=_url(raw), incarnation=_text(raw, "incarnation"))
