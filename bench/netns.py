"""Hosts on one kernel: one network namespace per "host", joined by a bridge (a switch).

A :class:`Fabric` makes a switch namespace holding a bridge and, per host, a namespace with one
interface (``eth0``) whose veth peer is a port of the bridge. Addresses come from a private test
range (``10.213.0.0/24``) and exist only inside those namespaces: nothing is added to the
namespace the caller runs in. Processes run on a host through :meth:`Fabric.exec_prefix`
(``ip netns exec``); the caller's own HTTP clients reach the hosts through
:meth:`Fabric.socket_factory`, which creates their sockets inside a host namespace (the caller's
thread enters it for the one ``socket()`` call and comes back).

:meth:`Fabric.cut` takes a host's port on the switch down: its cable is pulled, its peers see
silence (no RST, no ICMP), and :meth:`Fabric.restore` plugs it back in. Everything is torn down
by :meth:`Fabric.close` (also on errors, as a context manager); namespaces that a crashed run
left behind (their creator's pid is gone) are removed by the next :meth:`Fabric.open`.

    with Fabric(["gw", "p0", "d0"]) as fabric:
        fabric.address("p0")                      # "10.213.0.2"
        subprocess.Popen([*fabric.exec_prefix("p0"), "python", ...])
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

NS_PREFIX = "pdsv"  # every namespace this module makes is named pdsv-<pid>-<name>
SUBNET_PREFIX = "10.213.0."  # private test range, one /24 per fabric (its own switch)
HOST_IF = "eth0"
CLONE_NEWNET = 0x40000000
IP_TIMEOUT_S = 10.0


class FabricError(RuntimeError):
    """An ``ip`` command failed (its stderr is the message)."""


def _ip(*args: str) -> str:
    try:
        done = subprocess.run(
            ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FabricError(f"ip {' '.join(args)}: {e}") from e
    if done.returncode != 0:
        raise FabricError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def unavailable_reason() -> str | None:
    """Why this machine cannot make a fabric (not root, no ``ip``, the kernel or container
    refuses namespaces or veths), or None when it can. Tries for real, cleans up after."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the iproute2 'ip' command is missing"
    try:
        with Fabric(["probe"]) as fabric:
            # Both ways in: a process started there (ip netns exec mounts a sysfs) and a
            # socket of this thread (setns).
            argv = [*fabric.exec_prefix("probe"), sys.executable, "-c", "pass"]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
            if done.returncode != 0:
                return f"ip netns exec is refused here: {done.stderr.strip()}"
            fabric.socket_factory("probe")((socket.AF_INET, socket.SOCK_STREAM, 0, "", ())).close()
    except (FabricError, OSError, subprocess.TimeoutExpired) as e:
        return f"this kernel/container refuses network namespaces, veths or setns: {e}"
    return None


@dataclass(frozen=True)
class LinkBytes:
    """Bytes a host's interface received and sent (kernel counters)."""

    rx: int
    tx: int


class Fabric:
    """Namespaces ``hosts`` (in order: addresses .1, .2, ...) on one bridge; see the module."""

    def __init__(self, hosts: list[str], tag: str | None = None) -> None:
        if len(set(hosts)) != len(hosts) or not hosts or len(hosts) > 200:
            raise ValueError(f"need 1-200 distinct host names, got {hosts}")
        self.hosts = list(hosts)
        self.tag = tag or f"{os.getpid()}"
        self._made: list[str] = []

    def __enter__(self) -> Fabric:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- names -----------------------------------------------------------------------------

    @property
    def switch_ns(self) -> str:
        return f"{NS_PREFIX}-{self.tag}-sw"

    def ns(self, host: str) -> str:
        """The namespace name of ``host``."""
        if host not in self.hosts:
            raise KeyError(host)
        return f"{NS_PREFIX}-{self.tag}-{host}"

    def address(self, host: str) -> str:
        """``host``'s IPv4 address (on its ``eth0``)."""
        return f"{SUBNET_PREFIX}{self.hosts.index(host) + 1}"

    def _port(self, host: str) -> str:
        return f"port{self.hosts.index(host)}"  # the host's veth end on the switch

    def exec_prefix(self, host: str) -> tuple[str, ...]:
        """Prepend to an argv to run it on ``host``."""
        return ("ip", "netns", "exec", self.ns(host))

    # -- life ------------------------------------------------------------------------------

    def open(self) -> None:
        """Make the switch, the hosts and their links; all of it removed again on failure."""
        remove_stale_namespaces()
        try:
            self._add_ns(self.switch_ns)
            _ip("-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch_ns, "link", "set", "br0", "up")
            for host in self.hosts:
                self._add_host(host)
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def _add_host(self, host: str) -> None:
        ns, sw, port = self.ns(host), self.switch_ns, self._port(host)
        self._add_ns(ns)
        # Made inside the switch namespace with its peer sent straight to the host's: no
        # interface ever appears in the caller's namespace.
        _ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", HOST_IF, "netns", ns)
        _ip("-n", sw, "link", "set", port, "master", "br0")
        _ip("-n", sw, "link", "set", port, "up")
        _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", HOST_IF)
        _ip("-n", ns, "link", "set", HOST_IF, "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Delete every namespace made (their veths go with them); idempotent. Processes
        still running on a host keep its namespace alive but unreachable: stop them first."""
        errors = []
        for name in reversed(self._made):
            try:
                _ip("netns", "delete", name)
            except FabricError as e:
                errors.append(str(e))
        self._made.clear()
        if errors:
            raise FabricError("; ".join(errors))

    # -- faults and counters ---------------------------------------------------------------

    def cut(self, host: str) -> None:
        """Pull ``host``'s cable: its switch port goes down, so nothing reaches it or leaves it
        and its peers hear nothing at all (no reset, no unreachable)."""
        _ip("-n", self.switch_ns, "link", "set", self._port(host), "down")

    def restore(self, host: str) -> None:
        """Plug ``host``'s cable back in."""
        _ip("-n", self.switch_ns, "link", "set", self._port(host), "up")

    def link_bytes(self, host: str) -> LinkBytes:
        """The kernel's byte counters of ``host``'s ``eth0``."""
        [link] = json.loads(_ip("-n", self.ns(host), "-j", "-s", "link", "show", HOST_IF))
        stats = link["stats64"]
        return LinkBytes(rx=int(stats["rx"]["bytes"]), tx=int(stats["tx"]["bytes"]))

    # -- the caller's clients --------------------------------------------------------------

    def socket_factory(self, host: str) -> Callable[[tuple], socket.socket]:
        """A socket factory (aiohttp's ``TCPConnector(socket_factory=...)``) whose sockets live
        in ``host``'s namespace: a client there, with no address outside the fabric."""
        path = f"/var/run/netns/{self.ns(host)}"

        def make(addr_info: tuple) -> socket.socket:
            family, type_, proto = addr_info[0], addr_info[1], addr_info[2]
            with in_netns(path):
                return socket.socket(family, type_, proto)

        return make


@contextlib.contextmanager
def in_netns(path: str) -> Iterator[None]:
    """The calling thread in the network namespace at ``path`` for the block (sockets made
    there stay in it); back in its own after. Other threads are not affected."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {path}")
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:  # a thread stuck elsewhere is unusable
                raise OSError(ctypes.get_errno(), "setns back to the caller's namespace")
    finally:
        os.close(target)
        os.close(own)


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces of this module whose creating process is gone (a crashed run);
    the names removed."""
    try:
        listing = _ip("netns", "list")
    except FabricError:
        return []
    removed = []
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != NS_PREFIX or not parts[1].isdigit():
            continue
        if _pid_alive(int(parts[1])):
            continue
        with contextlib.suppress(FabricError):
            _ip("netns", "delete", name)
            removed.append(name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
