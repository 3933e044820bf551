"""Who may call what on a pdserve listener (a worker's or a router's): three credentials, each
opening only its own routes (least privilege).

- ``--api-key`` (one or more client keys): the OpenAI routes, ``/tokenize``, ``/detokenize``,
  and aborts of the requests that key started.
- ``--admin-api-key``: the control plane (workers list/add/remove, ``/debug/*``, ``/drain``, any
  abort, ``/metrics`` unless ``--metrics-open``). Without one, these answer only to loopback
  clients.
- ``--registration-token``: self-registration (``/workers/register``, ``/workers/deregister``)
  and nothing else; without one, registration is open (``--worker-allow`` and the identity
  check still apply).

Health probes (and a worker's ``/server_info``, its identity) stay open. Every app names the
access kind of each of its routes in one table (:class:`AccessPolicy` refuses to serve an app
with a route missing from it). Keys are compared in constant time and never logged; a request's
owner is a hash of the client key that started it.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web

logger = logging.getLogger(__name__)

OPEN = "open"  # health probes, identity
CLIENT = "client"  # the OpenAI routes, tokenize
ABORT = "abort"  # a client's own requests; an admin's any
ADMIN = "admin"  # the control plane
METRICS = "metrics"  # admin, unless metrics_open
REGISTRATION = "registration"  # self-registration of workers
KINDS = (OPEN, CLIENT, ABORT, ADMIN, METRICS, REGISTRATION)

ANONYMOUS = "anonymous"  # no client key configured: every client is this one owner
_OWNER_SALT = b"pdserve-request-owner:"


def owner_tag(key: str | None) -> str:
    """The owner a request started with ``key`` is recorded under (a hash: no key is kept in a
    request table or a log)."""
    if key is None:
        return ANONYMOUS
    return hashlib.sha256(_OWNER_SALT + key.encode()).hexdigest()[:32]


def as_keys(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """One key, several, or none as a tuple (empty strings dropped)."""
    if value is None:
        return ()
    keys = (value,) if isinstance(value, str) else tuple(value)
    return tuple(k for k in keys if k)


def add_key_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, admin_opens: str) -> None:
    """The client and admin key flags every listener takes (``admin_opens``: what the admin key
    opens there, besides any abort and /metrics)."""
    p.add_argument(
        "--api-key", action="append", default=None, metavar="KEY",
        help="a client key: /v1/*, /tokenize, /detokenize, aborts of its own requests; "
        "repeatable, one per client ($PDSERVE_API_KEY, comma-separated)",
    )  # fmt: skip
    p.add_argument(
        "--admin-api-key", default=None, metavar="KEY",
        help=f"{admin_opens}, any abort, /metrics; without it those answer only to loopback "
        "clients ($PDSERVE_ADMIN_API_KEY)",
    )  # fmt: skip
    p.add_argument("--metrics-open", action="store_true", help="/metrics without the admin key")


@dataclass(frozen=True)
class Credentials:
    """The secrets one listener checks. Empty: clients open, admin on loopback only,
    registration open."""

    api_keys: tuple[str, ...] = ()
    admin_api_key: str | None = None
    registration_token: str | None = None
    metrics_open: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "api_keys", as_keys(self.api_keys))
        secrets = [*self.api_keys, self.admin_api_key, self.registration_token]
        given = [s for s in secrets if s]
        if len(set(given)) != len(given):
            # One secret in two roles would let a client key open the control plane.
            raise ValueError("--api-key, --admin-api-key and --registration-token must all differ")


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request comes from: ``role`` (client, admin, registration or anonymous) and the
    owner tag of the requests it starts."""

    role: str
    owner: str = ANONYMOUS

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


@dataclass(frozen=True, slots=True)
class Denial:
    """A refusal: status (401 no or unknown credential, 403 the wrong one), message, code."""

    status: int
    message: str
    code: str

    @property
    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}


CALLER: web.RequestKey[Caller] = web.RequestKey("pdserve_caller", Caller)

_NEEDS = {CLIENT: "the client key (--api-key)", ADMIN: "the admin key (--admin-api-key)",
          REGISTRATION: "the registration token (--registration-token)"}  # fmt: skip


def is_loopback(remote: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and their IPv4-mapped form; False when unknown."""
    if not remote:
        return False
    try:
        address = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


class AccessPolicy:
    """Decides each request of one app from its route's kind (``kinds``: route template ->
    kind), the ``Authorization`` header and the peer address."""

    def __init__(self, creds: Credentials, kinds: Mapping[str, str], listener: str) -> None:
        unknown = {k for k in kinds.values() if k not in KINDS}
        if unknown:
            raise ValueError(f"unknown access kinds {sorted(unknown)}")
        self.creds = creds
        self.kinds = dict(kinds)
        self.listener = listener
        self._clients = [(f"Bearer {k}".encode(), owner_tag(k)) for k in creds.api_keys]
        self._admin = _bearer(creds.admin_api_key)
        self._registration = _bearer(creds.registration_token)

    def check_routes(self, app: web.Application) -> None:
        """Every route of ``app`` has a kind in the table (a new route without one fails here,
        at start, instead of serving with a guess)."""
        missing = sorted(
            {r.resource.canonical for r in app.router.routes() if r.resource is not None}
            - self.kinds.keys()
        )
        if missing:
            raise RuntimeError(f"{self.listener}: routes without an access kind: {missing}")

    def log_warnings(self) -> None:
        """Say at start what is open because a secret is not set."""
        creds = self.creds
        if creds.admin_api_key is None:
            logger.warning(
                "%s: no --admin-api-key: admin endpoints answer only to loopback clients",
                self.listener,
            )
        if creds.registration_token is None and REGISTRATION in self.kinds.values():
            logger.warning(
                "%s: no --registration-token: any host in --worker-allow may register",
                self.listener,
            )

    def kind_of(self, request: web.Request) -> str:
        """The route's kind; an unmatched path (a 404/405 to come) counts as a client route,
        a matched route missing from the table as admin (fail closed)."""
        resource = request.match_info.route.resource
        if resource is None:
            return CLIENT
        return self.kinds.get(resource.canonical, ADMIN)

    def decide(self, kind: str, authorization: str | None, remote: str | None) -> Caller | Denial:
        """The caller, or why it may not call a route of ``kind``."""
        given = (authorization or "").encode("utf-8", "replace")
        role, owner = self._identify(given)
        if kind == OPEN or (kind == METRICS and self.creds.metrics_open):
            return Caller(role if role else ANONYMOUS, owner)
        if kind in (ADMIN, METRICS):
            return self._admin_or_denial(role, given, remote)
        if kind == ABORT:
            admin = self._admin_or_denial(role, given, remote)
            if isinstance(admin, Caller):  # any request
                return admin
            # A client: the handler aborts only a request this caller's key started.
            return self._needs(CLIENT, role, given, self.creds.api_keys == (), owner)
        if kind == REGISTRATION:
            return self._needs(kind, role, given, self.creds.registration_token is None, owner)
        return self._needs(CLIENT, role, given, self.creds.api_keys == (), owner)

    def _identify(self, given: bytes) -> tuple[str, str]:
        """(role, owner) of the header: "" when none matches. Every configured secret is
        compared (constant time each), so the time taken says nothing of which matched."""
        role, owner = "", ANONYMOUS
        for expected, tag in self._clients:
            if hmac.compare_digest(given, expected):
                role, owner = "client", tag
        if self._admin is not None and hmac.compare_digest(given, self._admin):
            role = "admin"
        if self._registration is not None and hmac.compare_digest(given, self._registration):
            role = "registration"
        return role, owner

    def _admin_or_denial(self, role: str, given: bytes, remote: str | None) -> Caller | Denial:
        if self.creds.admin_api_key is None:
            if is_loopback(remote):
                return Caller("admin")
            return Denial(
                403,
                "Admin endpoints answer only to loopback clients while the server has no "
                "--admin-api-key.",
                "admin_loopback_only",
            )
        if role == "admin":
            return Caller("admin")
        return _denial(ADMIN, role, given)

    def _needs(
        self, kind: str, role: str, given: bytes, is_open: bool, owner: str
    ) -> Caller | Denial:
        wanted = "client" if kind == CLIENT else kind
        if is_open:
            return Caller(ANONYMOUS if kind == CLIENT else role or ANONYMOUS)
        if role == wanted:
            return Caller(role, owner)
        return _denial(kind, role, given)


def _denial(kind: str, role: str, given: bytes) -> Denial:
    if role:  # a valid credential of another role: known, but not allowed here
        return Denial(
            403,
            f"This credential may not call this endpoint: it needs {_NEEDS[kind]}.",
            "permission_denied",
        )
    what = "Incorrect" if given else "Missing"
    return Denial(
        401,
        f"{what} API key: send 'Authorization: Bearer <key>' with {_NEEDS[kind]}.",
        "invalid_api_key",
    )


def _bearer(secret: str | None) -> bytes | None:
    return f"Bearer {secret}".encode() if secret else None


def may_abort(caller: Caller, owner: str | None) -> bool:
    """An admin aborts any request; a client only one its own key started (``owner``: the
    request's tag, None if no such request is live)."""
    return caller.is_admin or (owner is not None and hmac.compare_digest(owner, caller.owner))


class RequestOwners:
    """Request id -> owner tag, for the requests being served and the last ``max_recent``
    ended ones: a router aborting a prefill leg whose HTTP answer already came (its KV still
    held for the decode) names a request that ended here, and still owns it."""

    def __init__(self, max_recent: int = 4096) -> None:
        self._live: dict[str, str] = {}
        self._recent: OrderedDict[str, str] = OrderedDict()
        self._max_recent = max_recent

    def start(self, request_id: str, owner: str) -> None:
        self._recent.pop(request_id, None)
        self._live[request_id] = owner

    def end(self, request_id: str) -> None:
        owner = self._live.pop(request_id, None)
        if owner is None:
            return
        self._recent[request_id] = owner
        while len(self._recent) > self._max_recent:
            self._recent.popitem(last=False)

    def get(self, request_id: str) -> str | None:
        return self._live.get(request_id) or self._recent.get(request_id)
