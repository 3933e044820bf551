"""A PD fleet on five "hosts" (network namespaces made by the test, bench/netns.py): the router
on a gateway host, 2 prefills and 2 decodes on four hosts of their own, KV over UCX's TCP
transport on the hosts' links; the workers register themselves with a router given none, and
share one bootstrap token. Greedy output equals a colocated worker's; a decode host cut
off the network and plugged back in fails its rooms ``peer_lost``, ends its requests, and
serves again with nothing restarted. Skipped where the machine cannot make namespaces."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import pytest_asyncio

from bench.abort_storm import traceback_invariant
from bench.cluster import ClusterSpec, check_idle, get_json, scrape
from bench.hosts import (
    BOOTSTRAP_PORT,
    HostsCluster,
    hosts_cluster,
    kv_transfer_rate,
    ucx_transports,
)
from bench.netns import unavailable_reason
from pdserve.transport.bootstrap import TOKEN_HEADER
from tests.e2e.conftest import fetch, wait_for
from tests.e2e.conftest import scrape as scrape_labelled

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = ["hello world " * 40, "The quick brown fox", "a b c d e f g " * 20, "1 2 3 4 5 6 7 8"]
MAX_TOKENS = 16
DETECT_S = 30.0  # heartbeat loss (2 x 0.5 s) and router health probes, with room for a busy CPU


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[HostsCluster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    spec = ClusterSpec(model_dir=str(demo_model_dir), num_prefill=2, num_decode=2,
                       log_dir=str(tmp_path_factory.mktemp("hosts")))  # fmt: skip
    async with hosts_cluster(spec, with_colocated=True) as cluster:
        yield cluster


async def complete(cluster: HostsCluster, url: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip
    status, raw = await fetch(cluster.session, "POST", f"{url}/v1/completions", body)
    assert status == 200, f"{url}: {status} {raw[:300]!r}"
    return orjson.loads(raw)


async def test_four_hosts_give_the_colocated_greedy_output_over_tcp(fleet: HostsCluster) -> None:
    assert fleet.colocated is not None
    for prompt in PROMPTS:
        pd = await complete(fleet, fleet.router.url, prompt)
        colo = await complete(fleet, fleet.colocated.url, prompt)
        assert pd["choices"][0]["text"] == colo["choices"][0]["text"], prompt
        assert pd["usage"]["completion_tokens"] == MAX_TOKENS
    for proc in fleet.workers:  # round robin: every prefill and decode served some
        m = await scrape(fleet.session, proc.url)
        assert m.get("pdserve_requests_total", 0) > 0, proc.name
    ids = {
        (await get_json(fleet.session, f"{p.url}/server_info"))["engine_id"] for p in fleet.workers
    }
    assert len(ids) == len(fleet.workers), f"engine ids collide across hosts: {ids}"
    # UCX reached its peers over TCP on the hosts' links only (no shared memory, no CMA).
    lanes = {p.name: ucx_transports(p.log_path) for p in fleet.workers}
    for p in fleet.prefills:
        assert lanes[p.name].get("inter-node") == {"tcp/eth0"}, lanes
    assert all(lane == "tcp/eth0" for kinds in lanes.values() for s in kinds.values() for lane in s)
    # The KV crossed the veths: a decode host received at least the KV bytes it was written.
    for d in fleet.decodes:
        received = (await scrape(fleet.session, d.url))["pdserve_transport_bytes_received_total"]
        assert received > 0 and fleet.fabric.link_bytes(d.name).rx >= received, d.name
    rate = await kv_transfer_rate(fleet.session, fleet.prefills)
    print(f"KV over veth (UCX tcp/eth0): {rate}")
    assert rate.num_rooms >= len(PROMPTS) and rate.gb_per_s > 0


async def open_dangling_room(fleet: HostsCluster) -> tuple[str, asyncio.Task]:
    """A decode-1 request whose prefill leg never comes: its room registers with prefill-0 and
    waits there for KV (until a deadline, or the link between them dies)."""
    room_id = uuid.uuid4().hex
    kv = {"room_id": room_id, "bootstrap_host": fleet.fabric.address("prefill-0"),
          "bootstrap_port": BOOTSTRAP_PORT}  # fmt: skip
    body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
            "kv_transfer_params": kv}  # fmt: skip
    url = f"{fleet.decodes[1].url}/v1/completions"
    task = asyncio.create_task(fetch(fleet.session, "POST", url, body, timeout_s=90))
    return room_id, task


async def room_ids(fleet: HostsCluster, proc_index: int) -> set[str]:
    url = f"{fleet.prefills[proc_index].url}/debug/rooms"
    return {r["id"] for r in (await get_json(fleet.session, url))["data"]}


async def peer_lost_rooms(fleet: HostsCluster, proc_index: int) -> float:
    m = await scrape_labelled(fleet.session, fleet.prefills[proc_index].url)
    ended = m.by_label("pdserve_rooms_ended_total", "outcome")
    return sum(n for outcome, n in ended.items() if outcome.startswith("Failed:peer_lost"))


async def worker_states(fleet: HostsCluster) -> dict[str, str]:
    listed = (await get_json(fleet.session, f"{fleet.router.url}/workers"))["data"]
    return {w["url"]: w["state"] for w in listed}


async def test_workers_found_the_router_themselves_and_guard_bootstrap_with_one_token(
    fleet: HostsCluster,
) -> None:
    assert not {"--prefill", "--decode", "--worker"} & set(fleet.router.argv)
    listed = (await get_json(fleet.session, f"{fleet.router.url}/workers"))["data"]
    roles = {w["url"]: w["role"] for w in listed}
    assert roles == {p.url: p.role for p in fleet.workers}, roles  # not the colocated one
    for p in fleet.prefills:
        peers = f"http://{fleet.fabric.address(p.name)}:{BOOTSTRAP_PORT}/peers"
        status, raw = await fetch(fleet.session, "GET", peers)
        assert status == 401 and b"bootstrap token" in raw, (status, raw[:300])
        wrong = {TOKEN_HEADER: "not-" + fleet.bootstrap_token}
        assert (await fetch(fleet.session, "GET", peers, headers=wrong))[0] == 401
        right = {TOKEN_HEADER: fleet.bootstrap_token}
        assert (await fetch(fleet.session, "GET", peers, headers=right))[0] == 200


async def test_a_cut_host_fails_its_rooms_and_rejoins_with_no_restart(fleet: HostsCluster) -> None:
    victim, prefill = fleet.decodes[1], fleet.prefills[0]
    info = {p.name: await get_json(fleet.session, f"{p.url}/server_info") for p in fleet.workers}
    room_id, dangling = await open_dangling_room(fleet)
    await wait_for(lambda: _has_room(fleet, room_id), 30, "the dangling room on prefill-0")
    lost_before = (await scrape(fleet.session, prefill.url))["pdserve_transport_peers_lost_total"]

    fleet.fabric.cut(victim.name)
    try:

        async def detected() -> bool:
            m = await scrape(fleet.session, prefill.url)
            gone = room_id not in await room_ids(fleet, 0)
            lost = m["pdserve_transport_peers_lost_total"] > lost_before
            # Unhealthy, or already forgotten (its lease lapsed while it was away).
            return gone and lost and (await worker_states(fleet)).get(victim.url) != "healthy"

        await wait_for(detected, DETECT_S, "prefill-0 and the router to see decode-1 gone")
        assert await peer_lost_rooms(fleet, 0) >= 1
        for prompt in PROMPTS:  # the rest of the fleet serves while the host is away
            await complete(fleet, fleet.router.url, prompt)
    finally:
        fleet.fabric.restore(victim.name)

    status, raw = await asyncio.wait_for(dangling, 90)
    assert status != 200 and b"peer_lost" in raw, (status, raw[:300])
    await fleet.wait_router_sees_all(DETECT_S)
    for p in fleet.workers:  # same lives: nothing was restarted
        now = await get_json(fleet.session, f"{p.url}/server_info")
        assert now["incarnation"] == info[p.name]["incarnation"], p.name

    async def victim_serves() -> bool:
        before = (await scrape(fleet.session, victim.url)).get("pdserve_requests_total", 0)
        await complete(fleet, fleet.router.url, PROMPTS[1])
        return (await scrape(fleet.session, victim.url)).get("pdserve_requests_total", 0) > before

    await wait_for(victim_serves, DETECT_S, "decode-1 to serve again", interval_s=0.2)
    idle = await check_idle(fleet.session, fleet.target(), max_wait_s=30)
    assert idle.is_idle, idle
    tb = traceback_invariant(fleet.target())
    assert tb.is_ok, tb.detail


async def _has_room(fleet: HostsCluster, room_id: str) -> bool:
    return room_id in await room_ids(fleet, 0)
