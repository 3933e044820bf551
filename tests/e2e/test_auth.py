"""Real processes with all three credentials: a prefill and a decode register themselves with a
router that requires the registration token, the official openai client chats through the
router with a client key, and each key opens only its own endpoints. Every secret travels in
the environment, as `pdserve up` and deploy/ pass them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.e2e.conftest import ROUTER_PD_READY, WORKER_ARGS, Proc, fetch, free_port, get_json
from tests.e2e.procs import running

pytestmark = pytest.mark.slow

CLIENT, ADMIN, TOKEN = "e2e-client-key", "e2e-admin-key", "e2e-registration-token"
WORKER_KEY, WORKER_ADMIN = "e2e-worker-key", "e2e-worker-admin-key"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("auth")
    port = free_port()
    router_env = {
        "PDSERVE_API_KEY": CLIENT,
        "PDSERVE_ADMIN_API_KEY": ADMIN,
        "PDSERVE_REGISTRATION_TOKEN": TOKEN,
        "PDSERVE_WORKER_API_KEY": WORKER_KEY,
    }
    router = Proc("router", ["router", "--port", str(port), "--health-interval", "0.3",
                             "--served-model-name", "demo"],
                  f"http://127.0.0.1:{port}", tmp / "router.log", env=router_env,
                  ready_path=ROUTER_PD_READY)  # fmt: skip
    worker_env = {
        "PDSERVE_API_KEY": WORKER_KEY,
        "PDSERVE_ADMIN_API_KEY": WORKER_ADMIN,
        "PDSERVE_REGISTRATION_TOKEN": TOKEN,
        "PDSERVE_BOOTSTRAP_TOKEN": "e2e-kv",
    }
    workers = {}
    for role in ("prefill", "decode"):
        wport = free_port()
        argv = ["serve", "--role", role, "--model", str(demo_model_dir), "--served-model-name",
                "demo", "--port", str(wport), *WORKER_ARGS, "--router", router.url,
                "--register-interval", "0.3", "--register-ttl", "60"]  # fmt: skip
        if role == "prefill":
            argv += ["--bootstrap-port", str(free_port())]
        workers[role] = Proc(role, argv, f"http://127.0.0.1:{wport}", tmp / f"{role}.log",
                             env=worker_env)  # fmt: skip
    # The router is ready once both workers registered (with the token) and are healthy.
    with running([router, *workers.values()]):
        yield {"router": router, **workers}


async def test_the_openai_client_chats_with_the_client_key_through_registered_workers(fleet):
    client = openai.AsyncOpenAI(
        base_url=f"{fleet['router'].url}/v1", api_key=CLIENT, max_retries=0, timeout=120
    )
    try:
        reply = await client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            temperature=0,
        )  # fmt: skip
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
        assert reply.id.startswith("chatcmpl-") and len(reply.id) >= len("chatcmpl-") + 32
    finally:
        await client.close()
    wrong = openai.AsyncOpenAI(
        base_url=f"{fleet['router'].url}/v1", api_key=ADMIN, max_retries=0, timeout=30
    )
    try:
        with pytest.raises(openai.PermissionDeniedError):  # the admin key is not a client key
            await wrong.models.list()
    finally:
        await wrong.close()


async def test_each_credential_opens_only_its_endpoints_on_router_and_workers(fleet):
    router, decode = fleet["router"].url, fleet["decode"].url
    async with aiohttp.ClientSession() as http:
        listed = (await get_json(http, f"{router}/workers", bearer(ADMIN)))["data"]
        assert {w["role"] for w in listed} == {"prefill", "decode"}
        assert all(w["registered"] and w["state"] == "healthy" for w in listed)
        for key, expected in ((None, 401), (CLIENT, 403), (TOKEN, 403)):
            headers = bearer(key) if key else {}
            assert (await fetch(http, "GET", f"{router}/workers", headers=headers))[0] == expected
            assert (await fetch(http, "GET", f"{router}/debug/requests", headers=headers))[
                0
            ] == expected
        # Registration needs the token: a client key cannot point the router anywhere.
        reg = {"url": "http://127.0.0.1:9", "role": "decode"}
        status, _ = await fetch(http, "POST", f"{router}/workers/register", reg, bearer(CLIENT))
        assert status == 403
        # A worker: the router's key serves, the worker's admin key drains, the router's own
        # client key opens nothing there.
        status, _ = await fetch(http, "GET", f"{decode}/v1/models", headers=bearer(WORKER_KEY))
        assert status == 200
        assert (await fetch(http, "GET", f"{decode}/v1/models", headers=bearer(CLIENT)))[0] == 401
        status, _ = await fetch(http, "GET", f"{decode}/debug/requests", headers=bearer(WORKER_KEY))
        assert status == 403
        status, _ = await fetch(http, "GET", f"{decode}/metrics", headers=bearer(WORKER_ADMIN))
        assert status == 200
        for url in (router, decode):
            assert (await fetch(http, "GET", f"{url}/health"))[0] == 200  # probes stay open
