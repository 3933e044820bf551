"""Who a worker is to its peers: the address it advertises and its default engine id.

A worker may bind a wildcard address (``--host 0.0.0.0``) that no peer can dial; what peers
and routers use is the advertised host (``--advertise-host``, else a concrete address of this
machine). The default engine id is built from it, so two workers on the same port of two hosts
never share an id (with the bind address they both were ``decode-0.0.0.0:30002``, and each
registration of one retired the other at the prefill as a "restart").
"""

from __future__ import annotations

import ipaddress
import logging
import socket

logger = logging.getLogger(__name__)

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def advertise_host(bind_host: str, explicit: str | None = None) -> str:
    """The host peers reach this worker at: ``explicit`` if given, else ``bind_host`` unless it
    is a wildcard, else this machine's primary address (see :func:`primary_address`)."""
    if explicit:
        return explicit
    if bind_host not in WILDCARD_HOSTS:
        return bind_host
    address = primary_address()
    logger.info("bound to %r: advertising %s (set --advertise-host to choose)", bind_host, address)
    return address


def primary_address() -> str:
    """The local IPv4 address of the default route, else the host name.

    A UDP socket "connected" to a public address sends nothing but makes the kernel pick the
    outgoing interface, whose address is the one other hosts most likely reach.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere, nothing is sent
            address = s.getsockname()[0]
        if not ipaddress.ip_address(address).is_unspecified:
            return address
    except OSError:
        pass  # no route at all (an isolated namespace): the host name is the best left
    return socket.gethostname()


def default_engine_id(role: str, advertised_host: str, port: int) -> str:
    """``<role>-<advertised host>:<port>``: unique across hosts, stable across restarts.

    Each life of a worker is told apart by its incarnation (new at every start), which the
    transport pairs with the engine id as the peer key ``<engine_id>@<incarnation>`` and which
    registration and ``/server_info`` carry too.
    """
    host = advertised_host.strip("[]")
    return f"{role}-{host}:{port}"


def http_url(host: str, port: int, scheme: str = "http") -> str:
    """``http://host:port`` (or ``https://``), an IPv6 address in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"
