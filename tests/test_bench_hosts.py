"""bench/hosts.py's readings: the UCX lanes a worker's log says it chose, the transfer rate."""

from __future__ import annotations

from pathlib import Path

from bench.hosts import TransferRate, ucx_transports

W = "[1.5] [vm:1:0]      ucp_worker.c:1997 UCX  INFO    prefill-10.213.0.2:30001@a4"
LOG = "\n".join([
    "[1.1] [vm:1:0]     ucp_context.c:2753 UCX  INFO  Version 1.23.0",
    f"{W} self cfg#0 rma_am(tcp/eth0)  am(tcp/eth0)",
    "[1.6] [vm:1:0]   | 0..inf | zero-copy   | tcp/eth0                          |",
    f"{W} inter-node cfg#1 rma_am(tcp/eth0)  amo_am(tcp/eth0)  am(tcp/eth0)",
    f"{W} intra-node cfg#2 rma(cma/memory) am(sysv/memory)",
])  # fmt: skip


def test_ucx_transports_reads_the_lanes_of_each_connection_kind(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text(LOG)
    assert ucx_transports(log) == {
        "self": {"tcp/eth0"},
        "inter-node": {"tcp/eth0"},
        "intra-node": {"cma/memory", "sysv/memory"},
    }
    assert ucx_transports(tmp_path / "missing.log") == {}


def test_transfer_rate_is_bytes_over_transfer_seconds() -> None:
    assert TransferRate(4, 2e9, 4.0).gb_per_s == 0.5
    assert TransferRate(0, 0.0, 0.0).gb_per_s == 0.0
