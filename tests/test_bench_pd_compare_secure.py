"""bench/pd_compare.py's pd_secure deployment: the same PD cluster with an API key and TLS on
every process, run beside pd in one invocation, with its throughput ratio reported (a smoke run
on the demo model with a few requests: the figures are the lead's to measure, not this test's)."""

from __future__ import annotations

import ssl
import sys
from pathlib import Path

import aiohttp
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import pd_compare  # noqa: E402
from bench.cluster import ClusterSpec  # noqa: E402


def test_pd_secure_serves_the_load_over_https_with_a_key_and_reports_its_ratio(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[tuple[str, int | None]] = []
    real_serve_load = pd_compare.serve_load

    async def checked_serve_load(url, tokenizer, args, conc, is_closing=False, secure=None):
        unauthenticated = None
        if secure is not None:  # the secured router refuses a client without the key
            ctx = ssl.create_default_context(cafile=str(secure.tls.ca))
            async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/models", ssl=ctx) as r:
                unauthenticated = r.status
        seen.append((url.split(":")[0], unauthenticated))
        return await real_serve_load(url, tokenizer, args, conc, is_closing, secure)

    monkeypatch.setattr(pd_compare, "serve_load", checked_serve_load)
    argv = ["--config", "demo", "--deployments", "pd,pd_secure", "--concurrency", "2",
            "--num-requests", "2", "--input-len", "16", "--output-len", "8"]  # fmt: skip
    assert pd_compare.main(argv) == 0  # no request failed on either cluster
    assert seen == [("http", None), ("https", 401)]
    out = capsys.readouterr().out
    assert "demo c2: pd_secure (API key + TLS) / pd throughput, same run: " in out
    assert "of off)" in out


def test_a_secured_spec_gives_every_process_the_tls_files_and_the_key(tmp_path: Path) -> None:
    from bench.tls_certs import make_certs

    certs = make_certs(tmp_path)
    spec = ClusterSpec(model_dir="m", tls=certs, api_key="k")
    args = spec.secure_args()
    assert spec.scheme == "https" and args[args.index("--api-key") + 1] == "k"
    assert args[args.index("--ssl-ca-certs") + 1] == str(certs.ca)
    assert ClusterSpec(model_dir="m").secure_args() == () and ClusterSpec("m").scheme == "http"
