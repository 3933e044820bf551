"""Reasoning end to end: real workers with --reasoning-parser qwen3 on the Qwen3-architecture
thinking demo, colocated and as a prefill/decode pair behind the router, with the official
openai client. The random model thinks until its budget forces </think>; then the JSON schema
constrains the answer. The decode leg continues the prefill leg's thinking block, so the pair
answers what the colocated worker answers, token for token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from pdserve.model.demo import DemoShape, write_demo_model

from .conftest import Cluster, Proc, router, worker

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["city", "n"],
}
PARSER = ("--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("thinking"), DemoShape(thinking=True))


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory, thinking_dir: Path) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("reasoning")
    colo: Proc = worker(tmp, "colocated-r", "colocated", thinking_dir, *PARSER).start()
    pre = worker(tmp, "prefill-r", "prefill", thinking_dir, *PARSER)
    dec = worker(tmp, "decode-r", "decode", thinking_dir, *PARSER)
    try:
        colo.wait_ready()
        with Cluster(pre, dec, router(tmp, [pre], [dec])).running() as cluster:
            yield {"colocated": colo.url, "pd": cluster.router.url}
    finally:
        colo.stop()


async def _ask(url: str, stream: bool) -> tuple[str, str, str | None]:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    args: dict[str, Any] = dict(
        model="demo",
        messages=[{"role": "user", "content": "Where and how many? JSON please."}],
        max_tokens=100,
        temperature=0.8,
        seed=21,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        extra_body={"thinking_token_budget": 10},
    )
    try:
        if not stream:
            done = await client.chat.completions.create(**args)
            msg = done.choices[0].message
            return msg.model_extra["reasoning_content"], msg.content, done.choices[0].finish_reason
        thought, content, finish = "", "", None
        async for chunk in await client.chat.completions.create(**args, stream=True):
            for choice in chunk.choices:
                thought += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return thought, content, finish
    finally:
        await client.close()


async def test_thinking_then_json_colocated_and_through_the_pd_pair(urls) -> None:
    answers = {
        (where, stream): await _ask(url, stream)
        for where, url in urls.items()
        for stream in (False, True)
    }
    thought, content, finish = answers["colocated", False]
    assert thought and "<think>" not in thought and "</think>" not in thought
    assert set(json.loads(content)) == {"city", "n"} and finish == "stop"
    # Streamed or not, colocated or split over two workers: one answer.
    assert set(answers.values()) == {(thought, content, finish)}
