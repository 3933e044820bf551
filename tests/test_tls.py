"""pdserve/tls.py: the TLS flags, their files checked at start naming the flag, and the
contexts a listener serves and a caller verifies with."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from bench.tls_certs import make_certs
from pdserve import launcher
from pdserve.api.app import start_http
from pdserve.tls import TLSConfig


def test_without_flags_everything_is_plain_http() -> None:
    tls = TLSConfig().check()
    assert not tls.is_enabled and tls.scheme == "http" and tls.server_context() is None
    assert tls.client_context().verify_mode == ssl.CERT_REQUIRED  # https peers still verified


def test_a_missing_or_bad_file_is_refused_naming_its_flag(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    with pytest.raises(ValueError, match="--ssl-keyfile needs --ssl-certfile"):
        TLSConfig(keyfile=str(certs.key))
    with pytest.raises(ValueError, match="--ssl-ca-certs: no such file"):
        TLSConfig(ca_certs=str(tmp_path / "absent.pem"))
    with pytest.raises(ValueError, match="--ssl-certfile/--ssl-keyfile: cannot load"):
        TLSConfig(str(certs.cert), str(certs.ca)).check()  # a key that is not the cert's
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match="--ssl-ca-certs: cannot load"):
        TLSConfig(ca_certs=str(junk)).check()


async def _hello(request: web.Request) -> web.Response:
    return web.json_response({"scheme": request.scheme})


async def test_a_listener_serves_https_that_only_a_client_trusting_its_ca_accepts(
    tmp_path: Path,
) -> None:
    certs = make_certs(tmp_path / "ours")
    other = make_certs(tmp_path / "theirs", ca_name="another CA")
    server_tls = TLSConfig(str(certs.cert), str(certs.key)).check()
    app = web.Application()
    app.router.add_get("/", _hello)
    runner, port = await start_http(app, "127.0.0.1", 0, ssl_context=server_tls.server_context())
    url = f"https://127.0.0.1:{port}/"
    timeout = aiohttp.ClientTimeout(total=10)
    try:
        trusting = TLSConfig(ca_certs=str(certs.ca)).client_context()
        async with aiohttp.ClientSession(timeout=timeout) as s, s.get(url, ssl=trusting) as r:
            assert await r.json() == {"scheme": "https"}
        for ctx in (TLSConfig(ca_certs=str(other.ca)).client_context(),
                    TLSConfig().client_context()):  # fmt: skip
            async with aiohttp.ClientSession(timeout=timeout) as s:
                with pytest.raises(aiohttp.ClientConnectorCertificateError):
                    await s.get(url, ssl=ctx)
        async with aiohttp.ClientSession(timeout=timeout) as s:  # plain HTTP to a TLS port
            with pytest.raises(aiohttp.ClientError):
                await s.get(f"http://127.0.0.1:{port}/")
    finally:
        await runner.cleanup()


async def test_pdserve_ups_readiness_poll_speaks_https_trusting_the_given_ca(
    tmp_path: Path,
) -> None:
    certs = make_certs(tmp_path)
    served = TLSConfig(str(certs.cert), str(certs.key), str(certs.ca)).check()
    app = web.Application()
    app.router.add_get("/health/ready", _hello)
    runner, port = await start_http(app, "127.0.0.1", 0, ssl_context=served.server_context())
    url = f"https://127.0.0.1:{port}"
    try:
        assert await asyncio.to_thread(launcher.is_ready, url, "/health/ready", served)
        assert not await asyncio.to_thread(launcher.is_ready, url, "/health/ready", TLSConfig())
    finally:
        await runner.cleanup()
