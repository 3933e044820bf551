"""A worker's advertised host and default engine id (pdserve/identity.py), from its flags."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli import add_serve_args
from pdserve.config_builder import server_config_from_args
from pdserve.identity import advertise_host, default_engine_id, http_url, primary_address


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


def test_a_concrete_bind_host_is_advertised_and_an_explicit_one_wins():
    assert advertise_host("10.0.0.7") == "10.0.0.7"
    assert advertise_host("0.0.0.0", "node-3.cluster") == "node-3.cluster"


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", ""])
def test_a_wildcard_bind_host_is_never_advertised(wildcard):
    host = advertise_host(wildcard)
    assert host == primary_address()
    assert host not in ("0.0.0.0", "::", "")


def test_two_hosts_on_the_same_port_get_different_default_engine_ids(tmp_path):
    ids = set()
    for advertised in ("10.0.0.1", "10.0.0.2"):
        args = parse("--model", str(tmp_path), "--role", "decode", "--host", "0.0.0.0",
                     "--advertise-host", advertised)  # fmt: skip
        config = server_config_from_args(args)
        assert config.engine.engine_id == config.transport.engine_id
        assert config.advertise_host == advertised
        ids.add(config.engine.engine_id)
    assert ids == {"decode-10.0.0.1:30002", "decode-10.0.0.2:30002"}
    assert default_engine_id("decode", "[fd00::1]", 30002) == "decode-fd00::1:30002"


def test_a_wildcard_bind_without_advertise_host_is_not_in_the_engine_id(tmp_path):
    args = parse("--model", str(tmp_path), "--role", "prefill", "--host", "0.0.0.0")
    config = server_config_from_args(args)
    assert "0.0.0.0" not in config.engine.engine_id
    assert config.transport.bootstrap_host == "0.0.0.0"  # still binds every interface


def test_router_flags_build_a_registration_and_the_token_reaches_the_transport(tmp_path):
    args = parse(
        "--model", str(tmp_path), "--router", "http://r1:30000", "--router", "http://r2:30000",
        "--register-interval", "0.5", "--register-ttl", "2", "--bootstrap-token", "s",
        "--registration-token", "k", "--api-key", "client-key",
    )  # fmt: skip
    config = server_config_from_args(args)
    reg = config.registration
    assert reg is not None and reg.router_urls == ("http://r1:30000", "http://r2:30000")
    # A registration carries the registration token, never the worker's own client key.
    assert (reg.interval_s, reg.ttl_s, reg.token) == (0.5, 2.0, "k")
    assert config.transport.bootstrap_token == "s"
    assert server_config_from_args(parse("--model", str(tmp_path))).registration is None
    bad = parse("--model", str(tmp_path), "--router", "http://r:1", "--register-ttl", "1")
    with pytest.raises(ValueError, match="--register-ttl"):
        server_config_from_args(bad)


def test_the_token_comes_from_the_environment_when_no_flag_gives_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_BOOTSTRAP_TOKEN", "from-env")
    config = server_config_from_args(parse("--model", str(tmp_path)))
    assert config.transport.bootstrap_token == "from-env"


def test_an_ipv6_advertised_host_makes_a_valid_url():
    assert http_url("fd00::1", 30001) == "http://[fd00::1]:30001"
    assert http_url("[fd00::1]", 30001) == "http://[fd00::1]:30001"
    assert http_url("10.0.0.1", 30001) == "http://10.0.0.1:30001"
    assert http_url("fd00::1", 30001, "https") == "https://[fd00::1]:30001"  # a TLS worker
