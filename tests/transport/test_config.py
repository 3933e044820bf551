"""TransportConfig: identity and validation."""

from __future__ import annotations

import pytest

from pdserve.transport.config import TransportConfig, peer_key


def test_each_config_gets_a_fresh_incarnation_but_keeps_its_engine_id() -> None:
    a, b = TransportConfig("prefill-0"), TransportConfig("prefill-0")
    assert a.incarnation != b.incarnation
    assert a.peer_key == peer_key("prefill-0", a.incarnation) == f"prefill-0@{a.incarnation}"


def test_peer_is_lost_after_two_heartbeat_intervals() -> None:
    assert TransportConfig("d", heartbeat_interval_s=0.2).peer_lost_after_s == pytest.approx(0.4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"engine_id": ""},
        {"engine_id": "a@b"},
        {"engine_id": "d", "incarnation": "x@y"},
        {"engine_id": "d", "heartbeat_interval_s": 0},
        {"engine_id": "d", "abort_quarantine_s": -1},
        {"engine_id": "d", "bootstrap_port": 70000},
        {"engine_id": "d", "max_chunk_pages": -1},
    ],
)
def test_invalid_settings_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        TransportConfig(**kwargs)
