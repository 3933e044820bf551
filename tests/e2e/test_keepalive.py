"""Keep-alive through real processes: a PD cluster whose prefill's KV reaches the decode only
after a second (an injected transport delay: the slowed worker) streams ``: keep-alive``
comments from the router every 0.2 s, then its tokens, to clients whose idle-read timeout is
two periods: aiohttp's and the official openai client's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from tests.e2e.conftest import Cluster, router, worker

PERIOD_S = 0.2
DELAY_S = 1.0  # > 3 periods before the first token
BODY = {"model": "demo", "prompt": "Tell me", "max_tokens": 8, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("keepalive")
    pre = worker(tmp, "prefill-0", "prefill", demo_model_dir,
                 "--fault-plan", f'{{"delay_s": {DELAY_S}}}')  # fmt: skip
    dec = worker(tmp, "decode-0", "decode", demo_model_dir)
    c = Cluster(pre, dec, router(tmp, [pre], [dec], "--sse-keepalive-s", str(PERIOD_S)))
    with c.running():
        yield c


async def test_a_slow_first_token_comes_after_comments_to_a_client_with_a_short_timeout(
    cluster: Cluster,
):
    timeout = aiohttp.ClientTimeout(total=60, sock_read=2 * PERIOD_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(cluster.router.url + "/v1/completions", json=BODY) as resp,
    ):
        assert resp.status == 200
        raw = await resp.read()
    comments, _, rest = raw.partition(b"data:")
    assert comments.count(b": keep-alive\n\n") >= 3  # the prefill's KV took > 3 periods
    assert (b"data:" + rest).rstrip().endswith(b"data: [DONE]")
    assert b": keep-alive" not in rest


async def test_the_openai_client_with_a_two_period_read_timeout_gets_its_tokens(
    cluster: Cluster,
):
    client = AsyncOpenAI(
        base_url=cluster.router.url + "/v1", api_key="unused", max_retries=0,
        timeout=openai.Timeout(60.0, read=2 * PERIOD_S),
    )  # fmt: skip
    try:
        stream = await client.completions.create(
            model="demo", prompt="Tell me", max_tokens=8, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = await asyncio.wait_for(_chunks(stream), 60.0)
        # Counted by usage, not by texts: a random demo token may end inside a UTF-8
        # character, and its delta's text is then empty (the bytes wait for the next token).
        (usage,) = [c.usage for c in chunks if c.usage is not None]
        assert usage.completion_tokens == 8
        assert any(c.choices and c.choices[0].text for c in chunks)
    finally:
        await client.close()


async def _chunks(stream: object) -> list:
    return [c async for c in stream]  # type: ignore[attr-defined]
