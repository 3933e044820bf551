"""Real processes: a prefill and a decode register themselves with two routers (no static
flags), share a bootstrap token, serve through either router, and leave both on SIGTERM."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from pdserve.transport.bootstrap import TOKEN_HEADER
from tests.e2e.conftest import (
    ROUTER_PD_READY,
    WORKER_ARGS,
    Proc,
    fetch,
    free_port,
    get_json,
    wait_for,
)

TOKEN = "e2e-bootstrap-secret"
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
        "temperature": 0}  # fmt: skip


def registered_worker(tmp: Path, role: str, model: Path, routers: list[Proc]) -> Proc:
    port = free_port()
    argv = ["serve", "--role", role, "--model", str(model), "--served-model-name", "demo",
            "--port", str(port), *WORKER_ARGS, "--register-interval", "0.3",
            # A lease far longer than the test: a worker gone from a router was deregistered.
            "--register-ttl", "120"]  # fmt: skip
    for r in routers:
        argv += ["--router", r.url]
    if role == "prefill":
        argv += ["--bootstrap-port", str(free_port())]
    env = {"PDSERVE_BOOTSTRAP_TOKEN": TOKEN}
    return Proc(role, argv, f"http://127.0.0.1:{port}", tmp / f"{role}.log", env=env)


@pytest.fixture
def fleet(tmp_path: Path, demo_model_dir: Path) -> Iterator[tuple[list[Proc], Proc, Proc]]:
    routers = []
    for i in range(2):
        port = free_port()
        argv = ["router", "--port", str(port), "--health-interval", "0.3"]
        url = f"http://127.0.0.1:{port}"
        log = tmp_path / f"router-{i}.log"
        routers.append(Proc(f"router-{i}", argv, url, log, ready_path=ROUTER_PD_READY))
    prefill = registered_worker(tmp_path, "prefill", demo_model_dir, routers)
    decode = registered_worker(tmp_path, "decode", demo_model_dir, routers)
    procs = [*routers, prefill, decode]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()  # a router is ready once a registered pair is healthy
        yield routers, prefill, decode
    finally:
        for p in reversed(procs):
            p.stop()


async def test_self_registered_workers_serve_through_two_routers_and_leave_on_sigterm(fleet):
    routers, prefill, decode = fleet
    async with aiohttp.ClientSession() as http:
        texts = []
        for router in routers:
            data = (await get_json(http, f"{router.url}/workers"))["data"]
            listing = {w["role"]: w for w in data}
            assert set(listing) == {"prefill", "decode"}
            for role, proc in (("prefill", prefill), ("decode", decode)):
                entry = listing[role]
                assert entry["url"] == proc.url and entry["registered"] and entry["compatible"]
                assert entry["engine_id"] == f"{role}-127.0.0.1:{proc.url.rsplit(':', 1)[1]}"
                assert entry["dtype"] and entry["kv_layout"]
            assert listing["prefill"]["kv_layout"] == listing["decode"]["kv_layout"]
            status, raw = await fetch(http, "POST", f"{router.url}/v1/chat/completions", CHAT)
            assert status == 200, raw
            texts.append(raw)
        assert _content(texts[0]) == _content(texts[1])  # greedy: the same pair, same answer

        # The bootstrap port is the token's: without it the prefill answers 401.
        info = await get_json(http, f"{prefill.url}/server_info")
        boot = f"http://127.0.0.1:{info['bootstrap_port']}/peers"
        assert (await fetch(http, "GET", boot))[0] == 401
        assert (await fetch(http, "GET", boot, headers={TOKEN_HEADER: TOKEN}))[0] == 200

        decode.stop()  # SIGTERM: the decode deregisters before it stops serving

        async def gone() -> bool:
            for router in routers:
                data = (await get_json(http, f"{router.url}/workers"))["data"]
                if any(w["role"] == "decode" for w in data):
                    return False
            return True

        await wait_for(gone, 10, "both routers forget the stopped decode")
        for router in routers:
            assert (await fetch(http, "GET", f"{router.url}/health/ready"))[0] == 503
    for proc in (*routers, prefill, decode):
        assert "Traceback" not in proc.log_text(), proc.log_tail()
    assert "deregistered" in decode.log_text()


def _content(raw: bytes) -> str:
    return orjson.loads(raw)["choices"][0]["message"]["content"]
