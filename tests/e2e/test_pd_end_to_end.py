"""The PD cluster through the router with the official openai client, real processes, real NIXL."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from tests.e2e.conftest import Cluster, Proc

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. " * 6, "a", "def main():\n"]


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


async def complete(url: str, prompt: str, max_tokens: int = 12) -> tuple[str, int]:
    resp = await client(url).completions.create(
        model="demo", prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return resp.choices[0].text, resp.usage.completion_tokens


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            values[key] = float(val)
    return values


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def wait_idle(proc: Proc, role: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll until every queue gauge is 0 and all pages are free; return the last scrape."""
    gauges = [
        "pdserve_waiting_requests",
        "pdserve_running_requests",
        "pdserve_prefill_inflight_requests",
        "pdserve_decode_waiting_for_kv_requests",
    ]
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(proc.url)
        busy = {g: m[f'{g}{{role="{role}"}}'] for g in gauges if m[f'{g}{{role="{role}"}}'] != 0}
        total, free = (
            m[f'pdserve_kv_pages_total{{role="{role}"}}'],
            m[f'pdserve_kv_pages_free{{role="{role}"}}']
            + m[f'pdserve_kv_pages_cached{{role="{role}"}}'],
        )
        if not busy and total == free:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"{proc.name} not idle: {busy}, pages free {free}/{total}")
        time.sleep(0.05)  # poll with a deadline


async def test_pd_greedy_equals_colocated_equals_offline_runner(
    pd_cluster: Cluster, colocated: Proc, demo_model_dir
):
    for prompt in PROMPTS:
        pd_text, pd_count = await complete(pd_cluster.router.url, prompt)
        colo_text, colo_count = await complete(colocated.url, prompt)
        assert (pd_text, pd_count) == (colo_text, colo_count) == (colo_text, 12)
        offline = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "pdserve", "generate", "--model", str(demo_model_dir),
             "--prompt", prompt, "--max-tokens", "12", "--ignore-eos", "--json"],
            capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        assert json.loads(offline.stdout.strip().splitlines()[-1])["text"] == pd_text


@pytest.mark.parametrize("seed", [None, 7])
async def test_pd_tokens_and_logprobs_are_bit_identical_to_colocated(
    pd_cluster: Cluster, colocated: Proc, seed: int | None
):
    """The decode worker continues from KV a prefill computed and sent over NIXL: by batch
    invariance its logprobs are the colocated worker's exactly (bf16 demo model), the first
    token's included, greedy and seeded."""
    temperature = 0.0 if seed is None else 0.8

    async def logprobs(url: str, prompt: str) -> tuple[list[str], list[float], list[dict]]:
        resp = await client(url).completions.create(
            model="demo", prompt=prompt, max_tokens=8, temperature=temperature, seed=seed,
            logprobs=2,
        )  # fmt: skip
        lp = resp.choices[0].logprobs
        assert all(len(top) >= 2 for top in lp.top_logprobs)
        return lp.tokens, lp.token_logprobs, lp.top_logprobs

    for prompt in ("Once upon a time", "The rain in Spain " * 9):
        pd = await logprobs(pd_cluster.router.url, prompt)
        colo = await logprobs(colocated.url, prompt)
        assert len(pd[0]) == 8
        assert pd == colo


async def test_pd_streaming_chat_matches_non_streaming(pd_cluster: Cluster):
    c = client(pd_cluster.router.url)
    messages = [{"role": "user", "content": "Tell me a story"}]
    full = await c.chat.completions.create(
        model="demo", messages=messages, max_tokens=16, temperature=0
    )
    pieces, finish = [], None
    stream = await c.chat.completions.create(
        model="demo", messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    usage = None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


async def test_many_concurrent_requests_complete_and_gauges_return_to_zero(pd_cluster: Cluster):
    c = client(pd_cluster.router.url)

    async def one(i: int) -> int:
        resp = await c.completions.create(
            model="demo", prompt="word " * (1 + 17 * (i % 7)), max_tokens=4 + i % 9,
            temperature=0.8, seed=i, extra_body={"ignore_eos": True},
        )  # fmt: skip
        return resp.usage.completion_tokens

    counts = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(24))), timeout=300)
    assert counts == [4 + i % 9 for i in range(24)]
    m = wait_idle(pd_cluster.prefill, "prefill")
    wait_idle(pd_cluster.decode, "decode")
    # Every room's transfer is in the histograms, its bytes as the transport counted them.
    assert m['pdserve_kv_transfer_seconds_count{role="prefill"}'] >= 24
    assert (
        m['pdserve_kv_transfer_bytes_sum{role="prefill"}']
        == m['pdserve_transport_bytes_sent_total{role="prefill"}']
    )
    for proc in (pd_cluster.prefill, pd_cluster.decode):
        assert get_json(f"{proc.url}/debug/rooms")["data"] == []
        assert get_json(f"{proc.url}/debug/requests")["data"] == []


@pytest.mark.parametrize("stream", [False, True])
async def test_worker_rejects_bad_input_with_openai_error(pd_cluster: Cluster, stream: bool):
    c = client(pd_cluster.router.url)
    with pytest.raises(openai.BadRequestError):
        await c.completions.create(model="demo", prompt="x", max_tokens=-1, stream=stream)
