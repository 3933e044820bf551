"""Prefix reuse across the PD hand-off: the decode keeps its own prefix cache and the prefill
writes only the pages after the prefix the decode holds (real processes, real NIXL)."""

from __future__ import annotations

from tests.e2e.conftest import Cluster, Proc
from tests.e2e.test_pd_end_to_end import client, scrape, wait_idle

BYTES = 'pdserve_transport_bytes_received_total{role="decode"}'


async def completion(url: str, prompt: str) -> tuple[str, int, int]:
    resp = await client(url).completions.create(
        model="demo", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    details = resp.usage.prompt_tokens_details
    return resp.choices[0].text, resp.usage.prompt_tokens, details.cached_tokens


async def test_decode_reuses_its_cached_prefix_and_receives_only_the_rest(
    pd_cluster: Cluster, colocated: Proc
):
    base = "A document about page caches, seen by this test alone. " * 8
    prompts = [base + "First question?", base + "Second, longer question here?", base]
    sent: list[float] = []
    results = []
    for prompt in prompts:
        before = scrape(pd_cluster.decode.url)[BYTES]
        results.append(await completion(pd_cluster.router.url, prompt))
        sent.append(scrape(pd_cluster.decode.url)[BYTES] - before)
    colocated_texts = [(await completion(colocated.url, p))[0] for p in prompts]
    assert [text for text, _, _ in results] == colocated_texts  # greedy, caches on both sides
    (_, n0, c0), (_, n1, c1), (_, n2, c2) = results
    assert c0 == 0 and c1 > 0 and c2 > 0
    # Bytes per request fall by the decode-cached fraction: only uncached pages travel.
    page_bytes = sent[0] / -(-n0 // 16)
    assert sent[1] == page_bytes * (-(-n1 // 16) - c1 // 16)
    assert sent[2] == page_bytes * (-(-n2 // 16) - c2 // 16) < sent[0]
    for proc, role in ((pd_cluster.prefill, "prefill"), (pd_cluster.decode, "decode")):
        m = wait_idle(proc, role)
        assert m[f'pdserve_kv_pages_used{{role="{role}"}}'] == 0
        assert m[f'pdserve_kv_pages_cached{{role="{role}"}}'] > 0
