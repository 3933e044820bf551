"""Migration of a speculating stream: the same cluster as test_migration.py, its decodes
speculating (one with a draft model, a random demo checkpoint of another seed; the other with
n-gram lookup). A decode SIGKILLed mid-answer, the stream goes on on the other with the text an
uninterrupted run gives, and that text is the plain (non-speculating) worker's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from pdserve.model.demo import DemoShape, write_demo_model
from tests.e2e.conftest import Proc, assign_distinct_ports, router, scrape, worker
from tests.e2e.procs import running
from tests.e2e.test_migration import (
    SAMPLINGS,
    MigrationCluster,
    _body,
    _ensure_whole,
    _stream,
    test_decode_killed_mid_stream_the_stream_continues_with_the_same_text,
)

__all__ = ["test_decode_killed_mid_stream_the_stream_continues_with_the_same_text"]


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path
) -> Iterator[MigrationCluster]:
    tmp = tmp_path_factory.mktemp("migration-spec")
    draft = write_demo_model(tmp / "draft", DemoShape(seed=7, num_layers=2))
    pre = worker(tmp, "prefill-0", "prefill", demo_model_dir)
    decodes = [
        worker(tmp, "decode-0", "decode", demo_model_dir, "--speculative-model", str(draft)),
        worker(tmp, "decode-1", "decode", demo_model_dir, "--speculative-method", "ngram",
               "--prompt-lookup-min", "1"),
    ]  # fmt: skip
    rt = router(tmp, [pre], decodes, "--connect-timeout", "1", "--request-timeout", "120")
    assign_distinct_ports([pre, *decodes, rt])
    with running([pre, *decodes, rt]):
        yield MigrationCluster(pre, decodes, rt)


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
async def test_a_speculating_stream_is_the_plain_workers_stream(
    cluster: MigrationCluster, colocated: Proc, kind: str
) -> None:
    body = _body("/v1/completions", SAMPLINGS[kind])
    async with aiohttp.ClientSession() as s:
        await _ensure_whole(s, cluster)  # a migration test may have killed a decode
        spec = await _stream(s, cluster.router.url, "/v1/completions", body)
        plain = await _stream(s, colocated.url, "/v1/completions", body)
        drafted = 0.0
        for d in cluster.decodes:
            drafted += (await scrape(s, d.url)).total("pdserve_spec_decode_draft_tokens_total")
    assert not spec.errors and spec.text == plain.text and spec.usage == plain.usage
    assert drafted > 0
