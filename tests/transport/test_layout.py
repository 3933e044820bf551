"""The KV layout check at registration: every field that differs is refused and named."""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
import pytest
import torch

from pdserve.fsm import RoomState
from pdserve.kernels.kv_cache import KVCacheConfig, KVPagePool
from pdserve.model.config import ModelConfig
from pdserve.transport.layout import layout_fingerprint, layout_of, model_fingerprint
from tests.transport.conftest import KV, Endpoints, outcome

LOCAL = "127.0.0.1"
HF = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
}


def pool(**overrides: Any) -> KVPagePool:
    return KVPagePool(KVCacheConfig(num_pages=16, **{**KV, **overrides}))


def test_fingerprint_is_stable_and_changes_with_the_architecture() -> None:
    base = ModelConfig.from_hf_dict(HF)
    assert model_fingerprint(base) == model_fingerprint(ModelConfig.from_hf_dict(dict(HF)))
    assert model_fingerprint(replace(base, checkpoint_dtype="float32")) == model_fingerprint(base)
    for change in ({"vocab_size": 512}, {"num_hidden_layers": 3}, {"rope_theta": 1e6}):
        assert model_fingerprint(ModelConfig.from_hf_dict({**HF, **change})) != model_fingerprint(
            base
        ), change


def test_layout_of_a_pool_reads_its_page_shape_and_dtype() -> None:
    layout = layout_of(pool(dtype=torch.float16), "m", "f")
    assert (layout.model, layout.fingerprint, layout.dtype) == ("m", "f", "float16")
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 16)
    assert (layout.page_size, layout.page_bytes) == (16, 2 * 2 * 16 * 2 * 16 * 2)


def test_the_layout_fingerprint_routers_compare_ignores_the_served_name_and_weights() -> None:
    base = layout_fingerprint(layout_of(pool(), "m", "f"))
    assert layout_fingerprint(layout_of(pool(), "renamed", "f")) == base
    # Routers compare the weights fingerprint as a field of its own (named when it differs).
    assert layout_fingerprint(layout_of(pool(), "m", "f", weights="w2")) == base
    assert len(base) == 16
    others = [
        layout_of(pool(dtype=torch.float16), "m", "f"),
        layout_of(pool(num_layers=4, head_dim=8), "m", "f"),  # same page bytes
        layout_of(pool(page_size=8, head_dim=32), "m", "f"),
        layout_of(pool(), "m", "another-architecture"),
    ]
    assert len({layout_fingerprint(x) for x in others} | {base}) == len(others) + 1


# Each case differs from the sender's layout in the named field(s). dtype and the layer/head
# case keep the page bytes equal: the old page-bytes check let exactly those pair up.
CASES = [
    ("dtype", dict(pool_kw={"dtype": torch.float16})),
    ("num_layers", dict(pool_kw={"num_layers": 4, "head_dim": 8})),
    ("num_kv_heads", dict(pool_kw={"num_kv_heads": 4, "head_dim": 8})),
    ("head_dim", dict(pool_kw={"head_dim": 32})),
    ("page_size", dict(pool_kw={"page_size": 8, "head_dim": 32})),
    ("model", dict(cfg={"model_name": "other-model"})),
    ("fingerprint", dict(cfg={"model_fingerprint": "feedbeef00000000"})),
    # One architecture, other weights (a fine-tune): its KV means nothing to the other.
    ("weights", dict(cfg={"weights_fingerprint": "0ther0000000weig"})),
]


@pytest.mark.parametrize("field, case", CASES, ids=[c[0] for c in CASES])
async def test_a_layout_mismatch_is_refused_and_the_decode_room_fails_naming_it(
    endpoints: Endpoints, field: str, case: dict[str, Any]
) -> None:
    identity = {"model_name": "demo", "model_fingerprint": "0123456789abcdef"}
    sender, _ = await endpoints.sender(**identity)
    receiver, rel = await endpoints.receiver(
        pool=pool(**case.get("pool_kw", {})), **{**identity, **case.get("cfg", {})}
    )
    room = await receiver.open_room("p", "req", LOCAL, sender.bootstrap_port, [1], 10)
    out = await outcome(room)
    assert out.state == RoomState.FAILED
    assert "layout_mismatch" in out.reason and f"{field} (prefill" in out.reason, out.reason
    assert rel.of("p") == [[1]]  # the sender never knew the pages: handed back at once
    assert sender.debug_peers() == [] and sender.stats["bad_requests"] == 1


async def test_a_matching_layout_registers(endpoints: Endpoints) -> None:
    identity = {"model_name": "demo", "model_fingerprint": "0123456789abcdef"}
    sender, _ = await endpoints.sender(**identity)
    receiver, _ = await endpoints.receiver(**identity)
    sender.open_room("ok", "req")
    room = await receiver.open_room("ok", "req", LOCAL, sender.bootstrap_port, [1], 10)
    assert sender.send("ok", [2], 10, first_token=1)
    assert (await outcome(room)).state == RoomState.SUCCESS


async def test_the_bootstrap_answer_is_a_400_naming_the_fields(endpoints: Endpoints) -> None:
    sender, _ = await endpoints.sender()
    receiver, _ = await endpoints.receiver()
    body = {
        "engine_id": "decode-9",
        "incarnation": "x",
        "agent_name": "decode-9@x",
        "metadata_b64": base64.b64encode(receiver.agent.metadata).decode(),
        "descriptor": receiver.agent.descriptor.to_json(),
        "layout": {**receiver.layout.to_dict(), "dtype": "float16", "page_size": 32},
    }
    url = f"http://{LOCAL}:{sender.bootstrap_port}/register"
    async with aiohttp.ClientSession() as http, http.post(url, data=orjson.dumps(body)) as resp:
        status, reply = resp.status, orjson.loads(await resp.read())
    assert (status, reply["error"]["code"]) == (400, "layout_mismatch")
    message = reply["error"]["message"]
    assert "dtype (prefill 'bfloat16', decode 'float16')" in message
    assert "page_size (prefill 16, decode 32)" in message and "head_dim" not in message
