"""Fixtures of the end-to-end tests (a demo model, a PD cluster, a colocated worker).

The helpers live in :mod:`tests.e2e.procs` (subprocesses, ports) and :mod:`tests.e2e.client`
(HTTP calls, metrics, idleness, streams); they are re-exported here for the tests that import
them from this module.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.client import (
    QUEUE_GAUGES,
    Metrics,
    StreamResult,
    ensure_whole,
    fetch,
    get_json,
    idle_problems,
    parse_metrics,
    scrape,
    stream_completion,
    wait_for,
    wait_idle,
    wait_router_sees_every_worker,
)
from tests.e2e.procs import (
    PORT_FLAGS,
    READY_TIMEOUT_S,
    ROUTER_PD_READY,
    WORKER_ARGS,
    Cluster,
    Proc,
    assign_distinct_ports,
    free_port,
    free_ports,
    router,
    worker,
)

__all__ = [
    "Cluster",
    "Metrics",
    "PORT_FLAGS",
    "Proc",
    "QUEUE_GAUGES",
    "READY_TIMEOUT_S",
    "ROUTER_PD_READY",
    "StreamResult",
    "WORKER_ARGS",
    "assign_distinct_ports",
    "ensure_whole",
    "fetch",
    "free_port",
    "free_ports",
    "get_json",
    "idle_problems",
    "parse_metrics",
    "router",
    "scrape",
    "stream_completion",
    "wait_for",
    "wait_idle",
    "wait_router_sees_every_worker",
    "worker",
]


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("demo-model")
    subprocess.run(
        [sys.executable, "-m", "pdserve", "make-demo-model", str(path)], check=True, timeout=300
    )
    return path


@pytest.fixture(scope="session")
def pd_cluster(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("pd")
    pre = worker(tmp, "prefill-0", "prefill", demo_model_dir)
    dec = worker(tmp, "decode-0", "decode", demo_model_dir)
    with Cluster(pre, dec, router(tmp, [pre], [dec])).running() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def colocated(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("colo")
    p = worker(tmp, "colocated-0", "colocated", demo_model_dir).start()
    try:
        yield p.wait_ready()
    finally:
        p.stop()
