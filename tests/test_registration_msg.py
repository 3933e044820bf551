"""The registration message workers send to routers: validated field by field."""

from __future__ import annotations

import pytest

from pdserve.registration_msg import DeregistrationMsg, RegistrationMsg

GOOD = {
    "url": "http://10.0.0.5:30001/",
    "role": "prefill",
    "model": "m",
    "dtype": "bfloat16",
    "kv_layout": "abc",
    "engine_id": "prefill-10.0.0.5:30001",
    "incarnation": "i1",
    "ttl_s": 6,
    "bootstrap_host": "10.0.0.5",
    "bootstrap_port": 8998,
}


def test_a_valid_registration_round_trips_with_a_normalized_url():
    msg = RegistrationMsg.from_json(GOOD)
    assert msg.url == "http://10.0.0.5:30001"
    assert msg.ttl_s == 6.0
    assert RegistrationMsg.from_json(msg.to_json()) == msg


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"url": "10.0.0.5:30001"}, "url"),
        ({"url": "http://h:1/path"}, "url"),
        ({"role": "router"}, "role"),
        ({"ttl_s": 0}, "ttl_s"),
        ({"ttl_s": "6"}, "ttl_s"),
        ({"ttl_s": 1e9}, "ttl_s"),
        ({"bootstrap_port": None}, "bootstrap_port"),  # a prefill must say where it is
        ({"bootstrap_port": True}, "bootstrap_port"),
        ({"bootstrap_host": 5}, "bootstrap_host"),
        ({"model": ""}, "model"),
        ({"incarnation": None}, "incarnation"),
        ({"engine_id": "x" * 300}, "engine_id"),
        ({"dtype": 3}, "dtype"),
    ],
)
def test_a_bad_field_is_named(change, field):
    with pytest.raises(ValueError, match=field):
        RegistrationMsg.from_json({**GOOD, **change})


def test_decode_needs_no_bootstrap_address_and_deregistration_is_validated():
    msg = RegistrationMsg.from_json({**GOOD, "role": "decode", "bootstrap_port": None})
    assert msg.bootstrap_port is None
    bye = DeregistrationMsg.from_json({"url": "http://h:1", "incarnation": "i1"})
    assert DeregistrationMsg.from_json(bye.to_json()) == bye
    with pytest.raises(ValueError, match="incarnation"):
        DeregistrationMsg.from_json({"url": "http://h:1"})
    with pytest.raises(ValueError):
        DeregistrationMsg.from_json([])
