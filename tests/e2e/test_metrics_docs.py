"""docs/operations.md names every metric exactly as a live PD cluster exports it, and every
exported ``pdserve_*`` metric is documented: scraped from a real prefill, decode and router
(with the optional parts on: a shared CPU lease and an inert fault plan), so the two cannot
drift apart again."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import Cluster, assign_distinct_ports, fetch, router, worker

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = ("docs/operations.md", "docs/architecture.md", "README.md")
# Every optional metric on: --cpu-lease (lease counters), --fault-plan (injected-fault counters;
# this plan injects nothing).
OPTIONAL = ["--fault-plan", '{"seed": 1}']


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("metrics-docs")
    lease = ["--cpu-lease", str(tmp / "cpu.lease"), *OPTIONAL]
    pre = worker(tmp, "prefill-0", "prefill", demo_model_dir, *lease)
    dec = worker(tmp, "decode-0", "decode", demo_model_dir, *lease, "--speculative-method", "ngram")
    c = Cluster(pre, dec, router(tmp, [pre], [dec]))
    assign_distinct_ports(c.procs)
    with c.running():
        yield c


def exported_names(text: str) -> set[str]:
    """Metric names as a scrape spells them: counters with ``_total``, the rest as declared
    (histograms by their base name)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def documented_names(text: str) -> set[str]:
    """Every ``pdserve_*`` name written in backticks (labels in braces dropped)."""
    spans = re.findall(r"`([^`]*)`", text)
    return {m for span in spans for m in re.findall(r"\bpdserve_[a-z0-9_]+", span)}


async def _scrape_all(c: Cluster) -> dict[str, set[str]]:
    async with aiohttp.ClientSession() as session:
        # One request through the router first: nothing should depend on it, but an exporter
        # that only names a family after its first sample would show here.
        body = {"model": "demo", "prompt": "Hi", "max_tokens": 2}
        status, _ = await fetch(session, "POST", f"{c.router.url}/v1/completions", body)
        assert status == 200
        out = {}
        for p in c.procs:
            status, raw = await fetch(session, "GET", f"{p.url}/metrics", timeout_s=10)
            assert status == 200
            out[p.name] = exported_names(raw.decode())
        return out


@pytest.fixture(scope="module")
def exported(cluster: Cluster) -> dict[str, set[str]]:
    return asyncio.run(_scrape_all(cluster))


def test_every_documented_metric_is_exported(exported: dict[str, set[str]]) -> None:
    everything = set().union(*exported.values())
    for doc in DOCUMENTS:
        missing = documented_names((REPO / doc).read_text()) - everything
        assert not missing, f"{doc} names metrics nothing exports: {sorted(missing)}"


def test_every_exported_metric_is_documented(exported: dict[str, set[str]]) -> None:
    documented = documented_names((REPO / "docs/operations.md").read_text())
    undocumented = {
        name: sorted(n for n in names if n.startswith("pdserve_") and not _covered(n, documented))
        for name, names in exported.items()
    }
    assert not any(undocumented.values()), f"undocumented metrics: {undocumented}"


def test_workers_export_their_resident_memory(exported: dict[str, set[str]]) -> None:
    for name in ("prefill-0", "decode-0"):
        assert "process_resident_memory_bytes" in exported[name], name
    operations = (REPO / "docs/operations.md").read_text()
    assert "`process_resident_memory_bytes`" in operations


def _covered(name: str, documented: set[str]) -> bool:
    # prometheus-client's own companion of a counter or histogram (the docs say so once).
    base = name.removesuffix("_created")
    return name in documented or (base != name and bool({base, f"{base}_total"} & documented))


def test_the_name_extraction_sees_counters_with_their_suffix() -> None:
    scrape = (
        "# HELP pdserve_aborts_total Requests aborted\n# TYPE pdserve_aborts_total counter\n"
        'pdserve_aborts_total{role="decode"} 0.0\n'
        "# HELP pdserve_rooms Live rooms\n# TYPE pdserve_rooms gauge\n"
    )
    assert exported_names(scrape) == {"pdserve_aborts_total", "pdserve_rooms"}
    doc = "| `pdserve_rooms{state}` | x |\n`pdserve_aborts_total`, `pdserve_x_total` and pdserve_no"
    assert documented_names(doc) == {"pdserve_rooms", "pdserve_aborts_total", "pdserve_x_total"}
