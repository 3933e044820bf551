"""``--worker-allow``: the hosts a worker URL (registered or added at run time) may name.

Without it, a registration or ``POST /workers`` could point the router at any address (a
cloud metadata endpoint, an internal service) and make it send probes there, or, once such a
"worker" answered, users' prompts. Entries are CIDRs (``10.0.0.0/8``, ``fd00::/64``) or host
names (``worker-0.pods``; with a leading dot, every name under it: ``.pods.svc``). The default
is loopback and the router's own networks (the address and prefix of each of its interfaces),
link-local ones left out (169.254.0.0/16 holds the metadata endpoints).

A name outside the named entries is resolved, and allowed only if every address it resolves to
is; the router dials the name again when it connects, so a name a hostile DNS may re-point
belongs in the list by name only if that DNS is trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import logging
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK: tuple[Network, ...] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
)
_LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B  # Linux ioctls: an interface's IPv4 and mask


@dataclass(frozen=True)
class WorkerAllowList:
    """CIDRs and host names a worker URL's host must fall in."""

    networks: tuple[Network, ...]
    names: tuple[str, ...] = ()

    @classmethod
    def parse(cls, entries: Sequence[str]) -> WorkerAllowList:
        """``--worker-allow`` entries; ValueError names a bad one. Empty: the default."""
        if not entries:
            return cls.default()
        networks: list[Network] = []
        names: list[str] = []
        for raw in entries:
            entry = raw.strip()
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            label = entry.lstrip(".")
            if not label or not all(c.isalnum() or c in "-." for c in label):
                raise ValueError(f"--worker-allow entry is neither a CIDR nor a host name: {raw!r}")
            names.append(entry.lower())
        return cls(tuple(networks), tuple(names))

    @classmethod
    def default(cls) -> WorkerAllowList:
        """Loopback and this machine's own networks, link-local ones left out."""
        own = [n for n in local_networks() if not any(n.subnet_of(ll) for ll in _LINK_LOCAL
                                                     if n.version == ll.version)]  # fmt: skip
        return cls(tuple(dict.fromkeys([*LOOPBACK, *own])))

    def describe(self) -> str:
        return ", ".join([*(str(n) for n in self.networks), *self.names]) or "nothing"

    def _is_named(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == n or (n.startswith(".") and host.endswith(n)) for n in self.names)

    def _is_in(self, address: str) -> bool:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        mapped = getattr(ip, "ipv4_mapped", None)
        ip = mapped or ip
        return any(ip.version == n.version and ip in n for n in self.networks)

    async def refusal(self, host: str, timeout_s: float) -> str | None:
        """Why ``host`` may not be a worker, or None if it may (a name is resolved, bounded by
        ``timeout_s``)."""
        host = host.strip("[]")
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
            is_address = True
        except ValueError:
            is_address = False
        if is_address:
            if self._is_in(host):
                return None
            return f"host {host} is not in --worker-allow ({self.describe()})"
        if self._is_named(host):
            return None
        try:
            async with asyncio.timeout(timeout_s):
                infos = await asyncio.get_running_loop().getaddrinfo(host, None)
        except (OSError, TimeoutError) as exc:
            return f"host {host} does not resolve ({exc or 'timed out'}); not in --worker-allow"
        addresses = sorted({str(info[4][0]) for info in infos})
        outside = [a for a in addresses if not self._is_in(a)]
        if outside or not addresses:
            return (
                f"host {host} resolves to {', '.join(outside) or 'nothing'}, not in "
                f"--worker-allow ({self.describe()})"
            )
        return None


def local_networks() -> list[Network]:
    """The network (address and prefix) of each interface of this machine: IPv4 by ioctl,
    IPv6 from /proc/net/if_inet6 (Linux; elsewhere, none found means loopback only)."""
    out: list[Network] = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                address = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK, request)[20:24])
            except OSError:
                continue  # no IPv4 address on this interface
            out.append(ipaddress.ip_network(f"{address}/{mask}", strict=False))
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 6:
                continue
            address = ipaddress.IPv6Address(int(fields[0], 16))
            out.append(ipaddress.ip_network(f"{address}/{int(fields[2], 16)}", strict=False))
    return out
