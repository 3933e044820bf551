"""TLS on every listener of a real PD cluster (demo model, subprocess servers, a CA made in
the test): the official openai client over https to the router, the router over https to both
workers (requests, health, /server_info), the decode over https to the prefill's bootstrap port
(the KV hand-off), and the decode registering itself with the router over https. Plain HTTP
to any of those ports gets no answer."""

from __future__ import annotations

import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from bench.tls_certs import CertFiles, make_certs
from tests.e2e.conftest import Cluster, Proc, router, worker
from tests.e2e.procs import assign_distinct_ports


def https(proc: Proc) -> None:
    proc.url = proc.url.replace("http://", "https://")


@pytest.fixture(scope="module")
def tls_cluster(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path
) -> Iterator[tuple[Cluster, CertFiles]]:
    tmp = tmp_path_factory.mktemp("tls")
    certs = make_certs(tmp / "certs")
    tls = ["--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key),
           "--ssl-ca-certs", str(certs.ca)]  # fmt: skip
    pre = worker(tmp, "prefill-tls", "prefill", demo_model_dir, *tls)
    dec = worker(tmp, "decode-tls", "decode", demo_model_dir, *tls)
    rtr = router(tmp, [pre], [], *tls)
    assign_distinct_ports([pre, dec, rtr])
    for p in (pre, dec, rtr):
        https(p)
        p.cafile = str(certs.ca)
    rtr.argv = [a.replace("http://", "https://") for a in rtr.argv]
    dec.argv += ["--router", rtr.url, "--register-interval", "0.5"]  # registers over https
    with Cluster(pre, dec, rtr).running() as cluster:
        yield cluster, certs


def test_the_openai_client_streams_and_completes_over_https_through_a_pd_pair(
    tls_cluster: tuple[Cluster, CertFiles],
) -> None:
    cluster, certs = tls_cluster
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    with httpx.Client(verify=ctx, timeout=60) as http:
        client = OpenAI(base_url=f"{cluster.router.url}/v1", api_key="none", http_client=http)
        chat = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
            temperature=0,
        )  # fmt: skip
        assert chat.choices[0].finish_reason in ("length", "stop")
        assert chat.usage is not None and chat.usage.completion_tokens >= 1
        stream = client.completions.create(
            model="demo", prompt="one two", max_tokens=5, temperature=0, stream=True
        )
        text = "".join(c.choices[0].text for c in stream if c.choices)
        assert text
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    with urllib.request.urlopen(f"{cluster.prefill.url}/metrics", context=ctx, timeout=10) as r:
        metrics = r.read().decode()
    # Both KV hand-offs went through the TLS bootstrap port: the prefill sent both rooms.
    sent = 'pdserve_kv_transfer_seconds_count{role="prefill"} '
    counts = [float(ln[len(sent) :]) for ln in metrics.splitlines() if ln.startswith(sent)]
    assert counts and counts[0] >= 2, metrics[-2000:]


def test_plain_http_and_an_untrusted_client_get_no_answer(
    tls_cluster: tuple[Cluster, CertFiles],
) -> None:
    cluster, _ = tls_cluster
    for proc in cluster.procs:
        plain = proc.url.replace("https://", "http://")
        with pytest.raises(OSError):  # a TLS port answers no plain-HTTP request
            urllib.request.urlopen(f"{plain}/health", timeout=5)
        with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):  # the system CAs
            urllib.request.urlopen(f"{proc.url}/health", timeout=5)
