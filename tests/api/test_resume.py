"""The router's internal migration fields: ``return_token_ids`` names each chunk's tokens,
``resume_params`` reaches the engine validated; bad values are 400s naming the field."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient

from pdserve.api.errors import ApiError
from pdserve.api.resume import parse_resume
from pdserve.engine.protocol import ResumeState

from .engine_double import MODEL, FakeEngine
from .sse_utils import parse_sse

VOCAB = 257


def test_resume_params_parse_into_the_engines_resume_state() -> None:
    state = parse_resume({"token_ids": [1, 2, 256], "num_text_chars": 3}, VOCAB)
    assert state == ResumeState((1, 2, 256), 3)
    assert parse_resume(None, VOCAB) is None


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ([1, 2], "resume_params"),
        ({"num_text_chars": 1}, "resume_params.token_ids"),
        ({"token_ids": "12"}, "resume_params.token_ids"),
        ({"token_ids": [1, VOCAB]}, "resume_params.token_ids[1]"),
        ({"token_ids": [-1]}, "resume_params.token_ids[0]"),
        ({"token_ids": [1], "num_text_chars": -1}, "resume_params.num_text_chars"),
        ({"token_ids": [1], "extra": 1}, "resume_params.extra"),
    ],
)
def test_bad_resume_params_are_400_naming_the_field(value: object, param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_resume(value, VOCAB)
    assert info.value.status == 400 and info.value.param == param


async def test_return_token_ids_tags_every_chunk_with_its_tokens(client: TestClient) -> None:
    body = {"model": MODEL, "prompt": "abcd", "max_tokens": 3, "stream": True}
    resp = await client.post("/v1/completions", json={**body, "return_token_ids": True})
    events, is_done = parse_sse(await resp.read())
    assert resp.status == 200 and is_done
    ids = [t for e in events for c in e["choices"] for t in c["token_ids"]]
    assert ids == list(b"abc")


async def test_resume_params_reach_the_engine(client: TestClient, engine: FakeEngine) -> None:
    resume = {"token_ids": [97, 98], "num_text_chars": 2}
    body = {"model": MODEL, "prompt": "abcd", "max_tokens": 5, "resume_params": resume}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    assert engine.requests[0].resume == ResumeState((97, 98), 2)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 2}, "resume_params"),
        ({"max_tokens": 2}, "resume_params.token_ids"),  # nothing left to generate
    ],
)
async def test_a_resume_needs_one_choice_with_tokens_left(
    client: TestClient, extra: dict, param: str
) -> None:
    resume = {"token_ids": [97, 98], "num_text_chars": 2}
    body = {"model": MODEL, "prompt": "abcd", "max_tokens": 5, "resume_params": resume}
    resp = await client.post("/v1/completions", json={**body, **extra})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == param
