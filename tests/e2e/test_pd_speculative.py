"""Through PD with the decode worker speculating (a draft model: a random demo checkpoint of
another seed, so most drafts are rejected and rolled back): tokens and logprobs are the plain
colocated worker's, bit for bit, greedy and seeded, and the decode ends idle."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.model.demo import DemoShape, write_demo_model
from tests.e2e.conftest import Cluster, Proc, router, worker
from tests.e2e.test_pd_end_to_end import client, scrape, wait_idle


@pytest.fixture(scope="module")
def spec_cluster(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path
) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("pd-spec")
    draft = write_demo_model(tmp / "draft", DemoShape(seed=7, num_layers=2))
    pre = worker(tmp, "prefill-0", "prefill", demo_model_dir)
    dec = worker(tmp, "decode-0", "decode", demo_model_dir, "--speculative-model", str(draft),
                 "--num-speculative-tokens", "3")  # fmt: skip
    with Cluster(pre, dec, router(tmp, [pre], [dec])).running() as cluster:
        yield cluster


@pytest.mark.parametrize("seed", [None, 7])
async def test_speculating_decode_is_bit_identical_to_plain_colocated(
    spec_cluster: Cluster, colocated: Proc, seed: int | None
) -> None:
    temperature = 0.0 if seed is None else 0.8

    async def seen(url: str, prompt: str) -> tuple:
        resp = await client(url).completions.create(
            model="demo", prompt=prompt, max_tokens=16, temperature=temperature, seed=seed,
            top_p=0.9 if seed else 1.0, logprobs=2, extra_body={"ignore_eos": True},
        )  # fmt: skip
        lp = resp.choices[0].logprobs
        return resp.choices[0].text, lp.tokens, lp.token_logprobs, lp.top_logprobs

    for prompt in ("def main(argv):\n    return 0\n" * 2, "The rain in Spain " * 9):
        assert await seen(spec_cluster.router.url, prompt) == await seen(colocated.url, prompt)
    m = wait_idle(spec_cluster.decode, "decode")
    assert m['pdserve_spec_decode_draft_tokens_total{role="decode"}'] > 0
    assert scrape(spec_cluster.decode.url)['pdserve_running_requests{role="decode"}'] == 0
