"""bench/netns.py: hosts as network namespaces on a bridge, made and removed by the caller;
a cut host hears nothing until restored. Skipped where namespaces are refused."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from bench import netns
from bench.netns import Fabric, FabricError, in_netns, remove_stale_namespaces, unavailable_reason

REASON = unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=REASON or "")
CONNECT_TIMEOUT_S = 1.0
OURS = f"{netns.NS_PREFIX}-{os.getpid()}-"  # the default tag: this process's namespaces


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def own_links() -> list[str]:
    out = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True)
    return sorted(link["ifname"] for link in json.loads(out.stdout))


@contextlib.contextmanager
def listener(fabric: Fabric, host: str) -> Iterator[int]:
    """A TCP listener on ``host``'s address (made inside its namespace); its port."""
    with in_netns(f"/var/run/netns/{fabric.ns(host)}"):
        srv = socket.socket()
    with srv:
        srv.bind((fabric.address(host), 0))
        srv.listen()
        yield srv.getsockname()[1]


def connects(fabric: Fabric, src: str, dst: str, port: int) -> bool:
    """True if a connection from ``src`` to ``dst`` is accepted; False on silence (timeout)."""
    sock = fabric.socket_factory(src)((socket.AF_INET, socket.SOCK_STREAM, 0, "", ()))
    with sock:
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect((fabric.address(dst), port))
        except TimeoutError:
            return False
        return True


def reconnects(fabric: Fabric, src: str, dst: str, port: int, within_s: float) -> bool:
    """True once a connection is accepted, trying until ``within_s`` has passed."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if connects(fabric, src, dst, port):
            return True
    return False


@needs_netns
def test_hosts_reach_each_other_and_a_cut_host_hears_nothing_until_restored() -> None:
    links_before = own_links()
    with Fabric(["a", "b"]) as fabric, listener(fabric, "b") as port:
        assert fabric.address("a") != fabric.address("b")
        assert connects(fabric, "a", "b", port)
        fabric.cut("b")
        assert not connects(fabric, "a", "b", port)  # silence, not a refusal
        fabric.restore("b")
        # Neighbour entries that went stale during the cut resolve again within seconds (one
        # ARP retry is 1 s): wait for the condition, bounded.
        assert reconnects(fabric, "a", "b", port, within_s=15.0)
        assert fabric.link_bytes("b").rx > 0
        assert own_links() == links_before  # nothing added to the caller's namespace
    assert not {n for n in namespaces() if n.startswith(OURS)}


@needs_netns
def test_a_failed_open_removes_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    made = []
    real = Fabric._add_host

    def failing(self: Fabric, host: str) -> None:
        if made:
            raise FabricError("refused")
        made.append(host)
        real(self, host)

    monkeypatch.setattr(Fabric, "_add_host", failing)
    with pytest.raises(FabricError):
        Fabric(["a", "b"]).open()
    assert made == ["a"]
    assert not {n for n in namespaces() if n.startswith(OURS)}


@needs_netns
def test_namespaces_of_a_crashed_run_are_removed_by_the_next() -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = f"{netns.NS_PREFIX}-{done.stdout.strip()}-x"  # its creator's pid is gone
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in remove_stale_namespaces()
        assert stale not in namespaces()
    finally:
        if stale in namespaces():
            subprocess.run(["ip", "netns", "delete", stale], check=False)


def test_host_names_must_be_distinct() -> None:
    with pytest.raises(ValueError):
        Fabric(["a", "a"])


def test_a_machine_without_root_is_told_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in (unavailable_reason() or "")
