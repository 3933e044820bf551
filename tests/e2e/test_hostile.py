"""Hostile and broken input against a live PD cluster (router, workers, the prefill's bootstrap
server): every bad request gets an OpenAI-style 4xx, never a 5xx, and good traffic goes on.

The cluster runs with ``--api-key`` on the router and the workers, so every call carries the key.
"""

from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.kernels.kv_cache import KVCacheConfig, KVPagePool
from pdserve.model.config import ModelConfig
from pdserve.model.fingerprint import weights_fingerprint
from pdserve.transport import KVAgent
from pdserve.transport.layout import layout_of, model_fingerprint
from pdserve.transport.messages import PoolDescMsg, RegisterMsg
from tests.e2e.conftest import (
    Cluster,
    assign_distinct_ports,
    fetch,
    get_json,
    router,
    scrape,
    stream_completion,
    wait_for,
    wait_idle,
    worker,
)

KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 * 1024
VICTIM_DEADLINE_S = 20
GOOD = {"model": "demo", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def _dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()  # json, not orjson: it writes NaN literals when asked to


def _hostile_cases() -> dict[str, tuple[str, bytes, int]]:
    """name -> (path, raw body, expected status)."""
    c = {"model": "demo", "prompt": "hi", "max_tokens": 2}
    m = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {
        "malformed_json": (COMPLETIONS, b'{"model": "demo", "prompt": ', 400),
        "not_an_object": (COMPLETIONS, b"[1, 2, 3]", 400),
        "empty_body": (COMPLETIONS, b"", 400),
        "max_tokens_is_a_string": (COMPLETIONS, _dumps({**c, "max_tokens": "5"}), 400),
        "prompt_is_an_object": (COMPLETIONS, _dumps({**c, "prompt": {"a": 1}}), 400),
        "messages_is_a_string": (CHAT, _dumps({**m, "messages": "hi"}), 400),
        "unknown_field": (COMPLETIONS, _dumps({**c, "frobnicate": True}), 400),
        "unknown_message_field": (CHAT, _dumps({**m, "messages": [{"role": "user", "x": 1}]}), 400),
        "missing_messages": (CHAT, _dumps({"model": "demo"}), 400),
        "empty_messages": (CHAT, _dumps({**m, "messages": []}), 400),
        "empty_prompt": (COMPLETIONS, _dumps({**c, "prompt": ""}), 400),
        "prompt_longer_than_window": (COMPLETIONS, _dumps({**c, "prompt": [7] * 5000}), 400),
        "max_tokens_zero": (COMPLETIONS, _dumps({**c, "max_tokens": 0}), 400),
        "max_tokens_negative": (CHAT, _dumps({**m, "max_tokens": -5}), 400),
        "max_tokens_beyond_window": (COMPLETIONS, _dumps({**c, "max_tokens": 10**9}), 400),
        "negative_temperature": (COMPLETIONS, _dumps({**c, "temperature": -0.5}), 400),
        "nan_temperature": (COMPLETIONS, _dumps({**c, "temperature": math.nan}), 400),
        "negative_top_p": (CHAT, _dumps({**m, "top_p": -1}), 400),
        "nan_top_p": (CHAT, _dumps({**m, "top_p": math.nan}), 400),
        "unknown_model": (COMPLETIONS, _dumps({**c, "model": "gpt-17"}), 404),
        "invalid_utf8": (COMPLETIONS, b'{"model": "demo", "prompt": "\xff\xfe\xfd"}', 400),
        "many_stop_strings": (COMPLETIONS, _dumps({**c, "stop": ["x"] * 5000}), 400),
        "huge_n": (CHAT, _dumps({**m, "n": 10**6}), 400),
        "body_over_limit": (COMPLETIONS, _dumps({**c, "prompt": "a" * (2 * MAX_BODY)}), 413),
    }


HOSTILE = _hostile_cases()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("hostile")
    flags = ["--api-key", KEY, "--max-body-kb", str(MAX_BODY // 1024)]
    pre = worker(tmp, "prefill-0", "prefill", demo_model_dir, *flags)
    # The victim room of the bootstrap test ends by this deadline (the prefill's is 60 s).
    victim_deadline = ["--timeout-waiting-for-input", str(VICTIM_DEADLINE_S)]
    dec = worker(tmp, "decode-0", "decode", demo_model_dir, *flags, *victim_deadline)
    rt = router(tmp, [pre], [dec], "--api-key", KEY, "--max-body-kb", str(MAX_BODY // 1024))
    c = Cluster(pre, dec, rt)
    assign_distinct_ports(c.procs)
    with c.running():
        yield c


def _assert_openai_error(status: int, raw: bytes, expected: int) -> None:
    assert status == expected, (status, raw[:300])
    err = orjson.loads(raw)["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)


async def _good_request_succeeds(s: aiohttp.ClientSession, c: Cluster) -> None:
    status, raw = await fetch(s, "POST", f"{c.router.url}{COMPLETIONS}", GOOD, AUTH)
    assert status == 200, raw[:300]
    assert orjson.loads(raw)["usage"]["completion_tokens"] == GOOD["max_tokens"]


@pytest.mark.parametrize("target", ["router", "decode"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_body_gets_an_openai_4xx_and_serving_goes_on(
    cluster: Cluster, target: str, case: str
):
    path, body, expected = HOSTILE[case]
    url = getattr(cluster, target).url
    async with aiohttp.ClientSession() as s:
        status, raw = await fetch(s, "POST", url + path, body, AUTH)
        _assert_openai_error(status, raw, expected)
        await _good_request_succeeds(s, cluster)


@pytest.mark.parametrize("target", ["router", "decode"])
async def test_api_key_is_required_on_router_and_workers(cluster: Cluster, target: str):
    url = getattr(cluster, target).url
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            status, raw = await fetch(s, "POST", url + COMPLETIONS, GOOD, headers)
            _assert_openai_error(status, raw, 401)
            status, _ = await fetch(s, "GET", f"{url}/v1/models", headers=headers)
            assert status == 401
        assert (await fetch(s, "GET", f"{url}/v1/models", headers=AUTH))[0] == 200
        assert (await fetch(s, "GET", f"{url}/health"))[0] == 200  # probes carry no key
        assert (await fetch(s, "GET", f"{url}/metrics"))[0] == 200
        await _good_request_succeeds(s, cluster)


# -- fuzz ----------------------------------------------------------------------------------------

_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
_values = st.recursive(
    _scalars | st.text(max_size=12) | st.just([]) | st.just({}),
    lambda inner: (
        st.lists(inner, min_size=1, max_size=4)
        | st.dictionaries(st.text(max_size=8), inner, min_size=1, max_size=4)
    ),
    max_leaves=8,
)
_FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n"]
_FIELDS += ["stop", "stream", "seed", "logprobs", "stream_options", "ignore_eos", "user"]
_FIELDS += ["kv_transfer_params", "presence_penalty", "frobnicate"]
_DELETE = object()


@st.composite
def _requests(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid body with up to two fields replaced, deleted or added; or raw bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from([CHAT, COMPLETIONS])), draw(st.binary(max_size=64))
    body: dict[str, Any] = {
        "model": "demo",
        "max_tokens": draw(st.integers(1, 6)),  # small: a valid body generates little
        "temperature": draw(st.floats(0, 2)),
        "n": draw(st.integers(1, 2)),
        "stream": draw(st.booleans()),
        "stop": draw(st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    }
    is_chat = draw(st.booleans())
    if is_chat:
        body["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=30))}]
    else:
        token_ids = st.lists(st.integers(0, 4095), min_size=1, max_size=16)
        body["prompt"] = draw(st.text(min_size=1, max_size=30) | token_ids)
    mutation = st.tuples(st.sampled_from(_FIELDS), _values | st.just(_DELETE))
    for name, value in draw(st.lists(mutation, max_size=2)):
        if value is _DELETE:
            body.pop(name, None)
        else:
            body[name] = value
    return (CHAT if is_chat else COMPLETIONS), json.dumps(body).encode()


def _post(url: str, raw: bytes) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", **AUTH}
    req = urllib.request.Request(url, data=raw, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(request=_requests())
def test_fuzzed_bodies_never_get_a_5xx(cluster: Cluster, request: tuple[str, bytes]):
    path, body = request
    status, raw = _post(cluster.router.url + path, body)
    assert status < 500, (status, raw[:300])
    if status != 200:
        _assert_openai_error(status, raw, status)


async def test_router_and_workers_are_healthy_and_idle_after_the_fuzz(cluster: Cluster):
    async with aiohttp.ClientSession() as s:
        await _good_request_succeeds(s, cluster)
        assert (await fetch(s, "GET", f"{cluster.router.url}/health/ready"))[0] == 200
        await wait_idle(s, cluster.prefill, "prefill", AUTH)
        await wait_idle(s, cluster.decode, "decode", AUTH)
        assert (await get_json(s, f"{cluster.router.url}/debug/requests", AUTH))["data"] == []


# -- a bad peer on the bootstrap channel ---------------------------------------------------------


class Rogue:
    """A NIXL agent in this process posing as a decode engine (real metadata, tiny pool)."""

    def __init__(self, model_dir: Path, incarnation: str) -> None:
        cfg = json.loads((model_dir / "config.json").read_text())
        # The workers' page size and dtype (defaults) and model identity: the prefill checks the
        # whole layout at registration.
        kv = KVCacheConfig(
            cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"], num_pages=4
        )
        self.ident = {"engine_id": "rogue", "incarnation": incarnation}
        loop = asyncio.get_running_loop()
        pool = KVPagePool(kv)
        arch = model_fingerprint(ModelConfig.from_dir(model_dir))
        self.layout = layout_of(pool, "demo", arch, weights_fingerprint(model_dir))
        self.agent = KVAgent(f"rogue@{incarnation}", pool, loop, lambda *_: None)
        self.agent.start()

    def register_msg(self, **override: Any) -> dict[str, Any]:
        desc = PoolDescMsg.from_dict(self.agent.descriptor.to_json())
        msg = RegisterMsg(**self.ident, agent_name=self.agent.name, metadata=self.agent.metadata,
                          descriptor=desc, layout=self.layout)  # fmt: skip
        return {**msg.to_dict(), **override}

    def room_msg(self, **override: Any) -> dict[str, Any]:
        return {**self.ident, "nonce": 1, "page_ids": [0], "num_tokens": 4, **override}


async def _steady_load(s: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> list[Any]:
    """Waves of 4 streamed requests until ``stop`` (at most 40 waves)."""
    body = {**GOOD, "max_tokens": 24}
    results: list[Any] = []
    for _ in range(40):
        wave = [stream_completion(s, url, body, AUTH, timeout_s=60) for _ in range(4)]
        results += await asyncio.gather(*wave)
        if stop.is_set():
            break
    return results


async def _room_on(s: aiohttp.ClientSession, url: str, room_id: str) -> dict[str, Any] | None:
    rooms = (await get_json(s, f"{url}/debug/rooms", AUTH))["data"]
    return next((r for r in rooms if r["id"] == room_id), None)


def _bootstrap_cases(
    old: Rogue, new: Rogue, victim_room: str
) -> list[tuple[str, str, Any, int, str | None]]:
    """(name, path, body, expected status, expected error code)."""
    fresh = f"hostile-{uuid.uuid4().hex}"
    ghost = {"engine_id": "ghost", "incarnation": "1"}
    reg = new.register_msg
    return [
        ("bad_json", "/register", b'{"engine_id": ', 400, "bad_request"),
        ("wrong_types", "/register", reg(engine_id=5), 400, "bad_request"),
        ("bad_base64", "/register", reg(metadata_b64="!!not base64!!"), 400, "bad_request"),
        ("not_its_name", "/register", reg(agent_name="someone@else"), 400, "bad_agent_name"),
        ("page_size", "/register", reg(descriptor={**reg()["descriptor"], "page_bytes": 8}),
         400, "page_size_mismatch"),
        ("layout", "/register", reg(layout={**reg()["layout"], "dtype": "float16"}),
         400, "layout_mismatch"),
        ("bad_metadata", "/register", reg(engine_id="evil", incarnation="1", agent_name="evil@1",
         metadata_b64="Z2FyYmFnZQ=="), 400, "bad_metadata"),
        ("room_not_object", f"/rooms/{fresh}", b"[1]", 400, "bad_request"),
        ("page_ids_type", f"/rooms/{fresh}", new.room_msg(page_ids="0,1"), 400, "bad_request"),
        ("negative_page", f"/rooms/{fresh}", new.room_msg(page_ids=[-1]), 400, "bad_request"),
        ("page_twice", f"/rooms/{fresh}", new.room_msg(page_ids=[1, 1]), 400, "bad_request"),
        ("page_out_of_pool", f"/rooms/{fresh}", new.room_msg(page_ids=[7]), 400, "bad_page_ids"),
        ("no_tokens", f"/rooms/{fresh}", new.room_msg(num_tokens=0), 400, "bad_request"),
        ("long_room_id", "/rooms/" + "r" * 300, new.room_msg(), 400, "bad_request"),
        ("unknown_peer", f"/rooms/{fresh}", {**new.room_msg(), **ghost}, 404, "unknown_peer"),
        ("steal_live_room", f"/rooms/{victim_room}", new.room_msg(), 409, "duplicate_room"),
        ("empty_heartbeat", "/heartbeat", {}, 400, "bad_request"),
        ("stale_heartbeat", "/heartbeat", old.ident, 409, "stale_incarnation"),
        ("stale_room", f"/rooms/{fresh}", old.room_msg(), 409, "stale_incarnation"),
        ("stale_abort", f"/abort/{victim_room}", {**old.ident, "nonce": 1, "reason": "x"},
         409, "stale_incarnation"),
        ("stale_register", "/register", old.register_msg(), 409, "stale_incarnation"),
        # Accepted (an abort may precede its room), but a room bound to another peer survives.
        ("abort_others_room", f"/abort/{victim_room}", {**new.ident, "nonce": 1, "reason": "x"},
         200, None),
    ]  # fmt: skip


async def _register(s: aiohttp.ClientSession, boot: str, rogue: Rogue) -> None:
    status, raw = await fetch(s, "POST", f"{boot}/register", rogue.register_msg())
    assert status == 200, raw


async def _heartbeats(s: aiohttp.ClientSession, boot: str, rogue: Rogue) -> None:
    """Keep the rogue registered (a silent peer is dropped after two heartbeat intervals)."""
    while True:
        await fetch(s, "POST", f"{boot}/heartbeat", rogue.ident, timeout_s=5)
        await asyncio.sleep(0.2)  # heartbeat cadence


async def _bootstrap_barrage(
    s: aiohttp.ClientSession, boot: str, model_dir: Path, victim_room: str
) -> tuple[list[str], int]:
    """Register rogue@old, replace it by rogue@new, then send every bad message.

    Returns the cases answered otherwise than expected, and the number of 400 answers expected.
    """
    old = Rogue(model_dir, uuid.uuid4().hex)
    await _register(s, boot, old)
    await old.agent.close()
    new = Rogue(model_dir, uuid.uuid4().hex)
    await _register(s, boot, new)  # retires rogue@old
    beating = asyncio.create_task(_heartbeats(s, boot, new))
    mismatches = []
    cases = _bootstrap_cases(old, new, victim_room)
    try:
        for name, path, body, expected, code in cases:
            status, raw = await fetch(s, "POST", boot + path, body)
            got = orjson.loads(raw).get("error", {}).get("code") if status != 200 else None
            if (status, got) != (expected, code):
                mismatches.append(f"{name}: {status} {raw[:200]!r}")
    finally:
        beating.cancel()
        await new.agent.close()
    return mismatches, sum(case[3] == 400 for case in cases)


def _start_victim(
    s: aiohttp.ClientSession, decode_url: str, port: int
) -> tuple[str, asyncio.Task[tuple[int, bytes]]]:
    """A live room that only its deadline ends: the decode leg alone, naming the prefill."""
    room = f"victim-{uuid.uuid4().hex}"
    kv = {"room_id": room, "bootstrap_host": "127.0.0.1", "bootstrap_port": port}
    body = {**GOOD, "kv_transfer_params": kv}
    task = asyncio.create_task(fetch(s, "POST", decode_url + COMPLETIONS, body, AUTH, 90))
    return room, task


async def test_bad_bootstrap_messages_are_rejected_logged_and_disturb_no_live_room(
    cluster: Cluster, demo_model_dir: Path
):
    pre, dec = cluster.prefill, cluster.decode
    async with aiohttp.ClientSession() as s:
        port = (await get_json(s, f"{pre.url}/server_info"))["bootstrap_port"]
        room, victim = _start_victim(s, dec.url, port)
        stop = asyncio.Event()
        load = asyncio.create_task(_steady_load(s, cluster.router.url, stop))
        try:
            before = await wait_for(lambda: _room_on(s, pre.url, room), 10, "victim room")
            m0 = await scrape(s, pre.url)
            boot = f"http://127.0.0.1:{port}"
            mismatches, num_bad = await _bootstrap_barrage(s, boot, demo_model_dir, room)
        finally:
            stop.set()
            results = await asyncio.wait_for(load, 120)
        assert not mismatches, mismatches
        assert results and all(r.is_complete and r.finish_reason == "length" for r in results)
        after = await _room_on(s, pre.url, room)
        assert after is not None and after["peer"] == before["peer"], after
        assert after["state"] == before["state"] == "WaitingForInput"

        status, raw = await asyncio.wait_for(victim, VICTIM_DEADLINE_S + 30)
        assert status == 504, raw  # its own deadline, as if the bad peer had never been there
        assert orjson.loads(raw)["error"]["code"] == "timeout:WaitingForInput"
        m1 = await scrape(s, pre.url)
        for counter, at_least in [("bad_requests", num_bad), ("stale_rejected", 3)]:
            name = f"pdserve_transport_{counter}_total"
            assert m1.total(name) - m0.total(name) >= at_least, counter
        log = pre.log_text()
        assert "bad request" in log and "stale_incarnation" in log and "bad_page_ids" in log
        await wait_idle(s, pre, "prefill", AUTH)
        await wait_idle(s, dec, "decode", AUTH)
