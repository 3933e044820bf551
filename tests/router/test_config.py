"""RouterConfig validation and URL normalization."""

from __future__ import annotations

import pytest

from pdserve.router.config import RouterConfig, normalize_worker_url


def test_urls_are_normalized_into_tuples():
    cfg = RouterConfig(prefill_urls=["http://127.0.0.1:30001/"], decode_urls=("http://h:2",))
    assert cfg.prefill_urls == ("http://127.0.0.1:30001",)
    assert cfg.decode_urls == ("http://h:2",)
    assert normalize_worker_url(" https://example:443 ") == "https://example:443"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"policy": "fastest"},
        {"max_attempts": 0},
        {"breaker_failures": 0},
        {"health_interval_s": 0},
        {"request_timeout_s": -1},
        {"first_byte_timeout_s": 0},
        {"port": 70000},
        {"max_body_bytes": 10},
        {"prefill_urls": ("http://a:1",), "decode_urls": ("http://a:1/",)},
        {"worker_urls": ("ftp://a:1",)},
        {"worker_urls": ("http://a",)},
    ],
)
def test_invalid_configs_are_rejected(kwargs):
    with pytest.raises(ValueError):
        RouterConfig(**kwargs)


def test_first_byte_timeout_defaults_to_request_timeout_and_is_capped_by_it():
    assert RouterConfig(request_timeout_s=30).effective_first_byte_timeout_s == 30
    assert RouterConfig(first_byte_timeout_s=5).effective_first_byte_timeout_s == 5
    cfg = RouterConfig(request_timeout_s=3, first_byte_timeout_s=5)
    assert cfg.effective_first_byte_timeout_s == 3
