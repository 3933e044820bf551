"""KV handed between engines of different TP sizes: P2 -> D1 and P1 -> D2 give the colocated
TP1 worker's tokens and logprobs, bit for bit, over real NIXL on loopback.

A TP engine's ranks share one engine pool whose pages are the TP1 pages (every KV head,
head-major: kernels/kv_cache.py), so a room moves the same bytes whatever either side's size.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.e2e.conftest import Cluster, Proc, router, wait_idle, worker
from tests.e2e.test_pd_end_to_end import client

pytestmark = pytest.mark.slow

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog. " * 9,  # several pages, chunked prefill
    "def main(argv):\n    return 0\n",
    "a",
    "import os\nimport sys\n\n" * 5,
    "Sphinx of black quartz, judge my vow.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "class Page:\n    pass\n" * 3,
]


async def _answers(url: str, seed: int | None) -> list[tuple[str, list[float]]]:
    """Every prompt at once (batched beside each other), greedy or seeded at 0.8."""

    async def one(prompt: str) -> tuple[str, list[float]]:
        resp = await client(url).completions.create(
            model="demo", prompt=prompt, max_tokens=10, logprobs=1, seed=seed,
            temperature=0.0 if seed is None else 0.8, extra_body={"ignore_eos": True},
        )  # fmt: skip
        choice = resp.choices[0]
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        return choice.text, list(choice.logprobs.token_logprobs)

    return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def tp_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path
) -> Iterator[Cluster]:
    prefill_tp, decode_tp = request.param
    tmp = tmp_path_factory.mktemp(f"pd-tp{prefill_tp}{decode_tp}")
    pre = worker(tmp, "prefill-0", "prefill", demo_model_dir, "-tp", str(prefill_tp))
    dec = worker(tmp, "decode-0", "decode", demo_model_dir, "-tp", str(decode_tp))
    with Cluster(pre, dec, router(tmp, [pre], [dec])).running() as cluster:
        yield cluster


@pytest.mark.parametrize("seed", [None, 7])
async def test_kv_handed_between_tp_sizes_gives_colocated_tp1_s_tokens_and_logprobs(
    tp_cluster: Cluster, colocated: Proc, seed: int | None
) -> None:
    expected = await _answers(colocated.url, seed)
    assert await _answers(tp_cluster.router.url, seed) == expected
    # every room, request and page is back on both sides (the engine pool is every rank's)
    async with aiohttp.ClientSession() as session:
        await wait_idle(session, tp_cluster.prefill, "prefill")
        await wait_idle(session, tp_cluster.decode, "decode")
