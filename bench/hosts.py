"""A PD cluster across "hosts" (network namespaces, bench/netns.py): the router on a gateway
host, every prefill and decode worker on a host of its own, each bound to its host's address on
the same ports as its peers (as on real machines), KV moved by NIXL over UCX's TCP transport on
the hosts' links. The bench's own HTTP clients live on the gateway host too. Workers find the
router by themselves (:func:`discovery_args`): the router starts knowing no worker, and the
cluster counts as started once it lists every worker healthy. All workers share one bootstrap
token (``$PDSERVE_BOOTSTRAP_TOKEN``, :attr:`HostsCluster.bootstrap_token`).

UCX is held to TCP on ``eth0`` (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=eth0``): namespaces share one
kernel, so UCX's shared-memory and CMA transports would work across them and hide the network
path. ``UCX_PROTO_INFO=y`` makes UCX log the transports each connection chose
(:func:`ucx_transports` reads them back from the workers' logs).

    async with hosts_cluster(ClusterSpec(model_dir=..., num_prefill=2, num_decode=2)) as c:
        c.fabric.cut("decode-1"); ...; c.fabric.restore("decode-1")
"""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.cluster import PDSERVE, ROUTER_READY_PATH, Cluster, ClusterSpec, ManagedProc, scrape
from bench.netns import Fabric
from pdserve.envs import ADMIN_API_KEY_ENV, BOOTSTRAP_TOKEN_ENV

GATEWAY = "gw"  # the router's host, and where the bench's clients connect from
PORTS = {"router": 30000, "prefill": 30001, "decode": 30002, "colocated": 30003}
BOOTSTRAP_PORT = 8998
UCX_ENV = {
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": "eth0",
    "UCX_LOG_LEVEL": "info",  # the protocol tables below are logged at info
    "UCX_PROTO_INFO": "y",
}
# "... <name>@<id> inter-node cfg#1 rma_am(tcp/eth0)  amo_am(tcp/eth0)  am(tcp/eth0)"
_UCX_EP_CFG = re.compile(r"ucp_worker\.c:\d+\s+UCX\s+INFO\s+\S+ (\S+) cfg#\d+ (.+)$")
_UCX_LANE = re.compile(r"\((\w+)/([\w.:-]+)\)")


def discovery_args(address: str, router_url: str) -> tuple[str, ...]:
    """The flags a worker on a host needs to be found: it registers itself with the router at
    ``router_url`` and renews its lease there, advertising its host's ``address`` (its
    registration URL, bootstrap address and default engine id). The router is given no
    worker URL at all."""
    return ("--advertise-host", address, "--router", router_url)


class HostsCluster(Cluster):
    """:class:`bench.cluster.Cluster` on a :class:`Fabric` whose hosts are
    :meth:`host_names` (the fabric must be open before :meth:`start`). With
    ``with_colocated``, a colocated worker on the gateway host too (outside the router: a
    reference for outputs)."""

    def __init__(self, spec: ClusterSpec, fabric: Fabric, with_colocated: bool = False) -> None:
        self.fabric = fabric
        # One secret for the fleet's bootstrap ports, in the environment (not in argv).
        self.bootstrap_token = secrets.token_hex(16)
        # The bench calls admin endpoints (/metrics, /debug/*, /workers) from the gateway host,
        # off every worker's loopback: every process gets this admin key, the bench sends it.
        self.admin_api_key = secrets.token_hex(16)
        super().__init__(spec)
        self.colocated = self._colocated() if with_colocated else None

    @staticmethod
    def host_names(spec: ClusterSpec) -> list[str]:
        prefills = [f"prefill-{i}" for i in range(spec.num_prefill)]
        return [GATEWAY, *prefills, *(f"decode-{i}" for i in range(spec.num_decode))]

    @property
    def procs(self) -> list[ManagedProc]:
        extra = [self.colocated] if self.colocated is not None else []
        return [*self.workers, *extra, self.router]

    @property
    def router_url(self) -> str:
        return f"http://{self.fabric.address(GATEWAY)}:{PORTS['router']}"

    def host_of(self, proc: ManagedProc) -> str:
        return proc.name if proc in self.workers else GATEWAY

    def _proc(self, name: str, host: str, role: str, argv: list[str]) -> ManagedProc:
        url = f"http://{self.fabric.address(host)}:{PORTS[role]}"
        env = self._env()
        if role != "router":
            env |= {**UCX_ENV, BOOTSTRAP_TOKEN_ENV: self.bootstrap_token}
        command = (*self.fabric.exec_prefix(host), *PDSERVE)
        log = self.log_dir / f"{name}.log"
        ready = ROUTER_READY_PATH if role == "router" else "/health/ready"
        return ManagedProc(name, role, argv, url, log, env, command=command, ready_path=ready)

    def _worker(self, name: str, role: str, host: str | None = None) -> ManagedProc:
        host = host or name
        address = self.fabric.address(host)
        # No --engine-id: the default (role-address:port) must be unique across hosts.
        argv = ["serve", "--role", role, "--model", self.spec.model_dir, "--host", address,
                "--port", str(PORTS[role]), "--served-model-name", self.spec.served_model_name,
                *self.spec.worker_args]  # fmt: skip
        if role != "colocated":  # the colocated reference stays outside the router
            argv += discovery_args(address, self.router_url)
        if role == "prefill":
            argv += ["--bootstrap-port", str(BOOTSTRAP_PORT)]
        return self._proc(name, host, role, argv)

    def _colocated(self) -> ManagedProc:
        return self._worker("colocated", "colocated", host=GATEWAY)

    def _router(self) -> ManagedProc:
        # No --prefill/--decode: every worker registers itself (discovery_args).
        argv = ["router", "--host", self.fabric.address(GATEWAY), "--port", str(PORTS["router"]),
                *self.spec.router_args]  # fmt: skip
        return self._proc("router", GATEWAY, "router", argv)

    def _env(self) -> dict[str, str]:
        return {**super()._env(), ADMIN_API_KEY_ENV: self.admin_api_key}

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_api_key}"}

    def _connector(self) -> aiohttp.TCPConnector:
        factory = self.fabric.socket_factory(GATEWAY)
        return aiohttp.TCPConnector(force_close=True, socket_factory=factory)


@contextlib.asynccontextmanager
async def hosts_cluster(
    spec: ClusterSpec, with_colocated: bool = False
) -> AsyncIterator[HostsCluster]:
    """Open a fabric with one host per process, start the cluster on it; on the way out stop
    every process, then remove the fabric (also when anything failed)."""
    with Fabric(HostsCluster.host_names(spec)) as fabric:
        cluster = HostsCluster(spec, fabric, with_colocated)
        async with cluster:
            yield cluster


def ucx_transports(log_path: Path) -> dict[str, set[str]]:
    """What UCX logged it chose per kind of connection (``self``, ``intra-node``,
    ``inter-node``): the set of ``transport/device`` lanes of each, e.g.
    ``{"inter-node": {"tcp/eth0"}}``."""
    out: dict[str, set[str]] = {}
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    for line in text.splitlines():
        m = _UCX_EP_CFG.search(line)
        if m:
            lanes = {f"{tl}/{dev}" for tl, dev in _UCX_LANE.findall(m.group(2))}
            out.setdefault(m.group(1), set()).update(lanes)
    return out


@dataclass(frozen=True)
class TransferRate:
    """KV written by the prefills (their ``pdserve_kv_transfer_*`` histograms): rooms, bytes,
    seconds from a room's first WRITE posted to its last done."""

    num_rooms: int
    num_bytes: float
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return (
            f"{self.num_rooms} rooms, {self.num_bytes / 1e6:.2f} MB in {self.seconds:.3f}s of "
            f"transfer = {self.gb_per_s:.3f} GB/s"
        )


async def kv_transfer_rate(
    session: aiohttp.ClientSession, prefills: list[ManagedProc]
) -> TransferRate:
    rooms = num_bytes = seconds = 0.0
    for proc in prefills:
        m = await scrape(session, proc.url)
        rooms += m.get("pdserve_kv_transfer_bytes_count", 0.0)
        num_bytes += m.get("pdserve_kv_transfer_bytes_sum", 0.0)
        seconds += m.get("pdserve_kv_transfer_seconds_sum", 0.0)
    return TransferRate(int(rooms), num_bytes, seconds)
