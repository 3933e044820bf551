"""Request migration on a real cluster (1 prefill, 2 decodes, a router with migration on): a
decode SIGKILLed mid-stream, and the client's stream continues on the other decode with exactly
the text an uninterrupted run gives (greedy and seeded), usage counting every token. Plus the
decode fallback: a decode worker prefills a request that comes without kv_transfer_params."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from bench.sse import choice_text, sse_events
from tests.e2e.conftest import (
    Proc,
    assign_distinct_ports,
    ensure_whole,
    fetch,
    get_json,
    router,
    scrape,
    wait_idle,
    worker,
)
from tests.e2e.procs import running

PROMPT = "Once upon a time"
NUM_TOKENS = 160
SAMPLINGS = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 1.0, "seed": 4242, "frequency_penalty": 0.5},
}
KILL_AFTER_CHUNKS = 8


@dataclass
class MigrationCluster:
    prefill: Proc
    decodes: list[Proc]
    router: Proc


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path
) -> Iterator[MigrationCluster]:
    tmp = tmp_path_factory.mktemp("migration")
    pre = worker(tmp, "prefill-0", "prefill", demo_model_dir)
    decodes = [worker(tmp, f"decode-{i}", "decode", demo_model_dir) for i in range(2)]
    rt = router(tmp, [pre], decodes, "--connect-timeout", "1", "--request-timeout", "120")
    assign_distinct_ports([pre, *decodes, rt])
    with running([pre, *decodes, rt]):
        yield MigrationCluster(pre, decodes, rt)


def _body(path: str, sampling: dict[str, Any]) -> dict[str, Any]:
    body = {"model": "demo", "max_tokens": NUM_TOKENS, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    return {**body, **sampling}


@dataclass
class Streamed:
    text: str
    ids: set[str]
    finish_reason: str | None
    usage: dict[str, int] | None
    errors: list[Any]
    saw_done: bool


async def _stream(
    s: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], on_chunk: Any = None
) -> Streamed:
    """Read a whole stream; ``on_chunk(n)`` is awaited after the n-th text chunk."""
    out = Streamed("", set(), None, None, [], False)
    num_chunks = 0
    timeout = aiohttp.ClientTimeout(total=180)
    async with s.post(url + path, data=orjson.dumps(body), timeout=timeout) as resp:
        assert resp.status == 200, await resp.read()
        async for sse in sse_events(resp):
            event = sse.data
            if event is None:
                out.saw_done = True
                continue
            if "error" in event:
                out.errors.append(event["error"])
                continue
            out.ids.add(event["id"])
            out.usage = event.get("usage") or out.usage
            for choice in event["choices"]:
                text = choice_text(choice)
                out.text += text
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
                if text:
                    num_chunks += 1
                    if on_chunk is not None:
                        await on_chunk(num_chunks)
    return out


async def _serving_decode(s: aiohttp.ClientSession, c: MigrationCluster) -> Proc:
    """The decode the router's only request in flight streams from."""
    reqs = (await get_json(s, f"{c.router.url}/debug/requests"))["data"]
    (req,) = reqs
    (url,) = [leg["worker"] for leg in req["legs"] if leg["role"] == "decode"]
    return next(d for d in c.decodes if d.url == url)


async def _ensure_whole(s: aiohttp.ClientSession, c: MigrationCluster) -> None:
    await ensure_whole(s, [c.prefill, *c.decodes], c.router.url)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
async def test_decode_killed_mid_stream_the_stream_continues_with_the_same_text(
    cluster: MigrationCluster, kind: str, path: str
):
    body = _body(path, SAMPLINGS[kind])
    async with aiohttp.ClientSession() as s:
        await _ensure_whole(s, cluster)
        whole = await _stream(s, cluster.router.url, path, body)
        assert whole.finish_reason == "length" and not whole.errors and whole.saw_done
        before = (await scrape(s, cluster.router.url)).total("pdserve_router_migrations_total")
        killed: list[Proc] = []

        async def kill_serving_decode(num_chunks: int) -> None:
            if num_chunks == KILL_AFTER_CHUNKS and not killed:
                victim = await _serving_decode(s, cluster)
                await asyncio.to_thread(victim.kill)
                killed.append(victim)

        cut = await _stream(s, cluster.router.url, path, body, kill_serving_decode)
        assert killed, "the stream ended before a decode could be killed"
        assert not cut.errors and cut.saw_done
        assert cut.text == whole.text  # nothing lost, nothing repeated, same continuation
        assert cut.finish_reason == "length" and len(cut.ids) == 1
        assert cut.usage is not None and cut.usage["completion_tokens"] == NUM_TOKENS
        assert cut.usage["prompt_tokens"] == whole.usage["prompt_tokens"]
        after = (await scrape(s, cluster.router.url)).total("pdserve_router_migrations_total")
        assert after == before + 1
        survivor = next(d for d in cluster.decodes if d is not killed[0])
        for p, role in [(cluster.prefill, "prefill"), (survivor, "decode")]:
            await wait_idle(s, p, role)


async def test_decode_prefills_a_request_without_kv_transfer_params_itself(
    cluster: MigrationCluster,
):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        await _ensure_whole(s, cluster)
        status, via_pd = await fetch(s, "POST", f"{cluster.router.url}/v1/completions", body)
        assert status == 200, via_pd
        decode = cluster.decodes[0]
        status, alone = await fetch(s, "POST", f"{decode.url}/v1/completions", body)
        assert status == 200, alone
        text = orjson.loads(alone)["choices"][0]["text"]
        assert text == orjson.loads(via_pd)["choices"][0]["text"]
        await wait_idle(s, decode, "decode")
