"""Request migration in the router: a stream that breaks after bytes reached the client is
resumed on another path with the tokens already streamed, and the client's stream continues."""

from __future__ import annotations

import orjson
import pytest

from pdserve.router.migration import StreamTracker, is_migratable
from tests.router.helpers import CHAT, post, sse_events

COMPLETION = {"model": "fake-model", "prompt": "hi", "max_tokens": 4}


def _texts(raw: bytes, is_chat: bool) -> list[str]:
    out = []
    for payload in sse_events(raw):
        if payload == b"[DONE]":
            continue
        for choice in orjson.loads(payload).get("choices", []):
            text = (choice.get("delta") or {}).get("content") if is_chat else choice.get("text")
            if text:
                out.append(text)
    return out


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_stream_broken_mid_answer_continues_on_another_decode(
    make_worker, make_router, path: str
):
    prefill = await make_worker("prefill")
    d1, d2 = await make_worker("decode"), await make_worker("decode")
    # Whichever decode is picked first dies after two chunks; the other resumes at t2.
    for d in (d1, d2):
        d.num_chunks, d.die_after_chunks = 3, 2
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(d1.url, d2.url))
    body = {**(CHAT if path.endswith("chat/completions") else COMPLETION), "stream": True}
    status, raw = await post(router, body, rid="mig-1", path=path)
    assert status == 200
    is_chat = path.endswith("chat/completions")
    assert _texts(raw, is_chat) == ["t0 ", "t1 ", "t2 "]  # nothing lost or repeated
    payloads = [orjson.loads(p) for p in sse_events(raw)[:-1]]
    assert {p["id"] for p in payloads} == {"mig-1"}  # the same stream id throughout
    assert all("token_ids" not in c for p in payloads for c in p["choices"])
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert sse_events(raw)[-1] == b"[DONE]"
    resumed = [r for d in (d1, d2) for r in d.requests if "resume_params" in r.body]
    assert [r.body["resume_params"] for r in resumed] == [
        {"token_ids": [0, 1], "num_text_chars": 6}
    ]
    assert prefill.requests[-1].body["resume_params"]["token_ids"] == [0, 1]
    assert router.stats.num_migrations == 1
    assert router.stats.requests_by_status["200"] == 1


async def test_migration_stops_at_its_limit_and_ends_the_stream_with_an_error(
    make_worker, make_router
):
    prefill = await make_worker("prefill")
    decodes = [await make_worker("decode") for _ in range(3)]
    for d in decodes:
        d.num_chunks, d.die_after_chunks = 10, 1
    router = await make_router(
        prefill_urls=(prefill.url,), decode_urls=tuple(d.url for d in decodes), migration_limit=2
    )
    status, raw = await post(router, {**CHAT, "stream": True}, rid="mig-2")
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == b"[DONE]" and b"stream_broken" in events[-2]
    assert _texts(raw, True) == ["t0 ", "t1 ", "t2 "]  # one chunk from each decode
    assert router.stats.num_migrations == 2
    assert router.stats.requests_by_status["stream_error"] == 1


async def test_reasoning_deltas_pass_through_and_such_a_stream_is_not_resumed(
    make_worker, make_router
):
    prefill, decode = await make_worker("prefill"), await make_worker("decode")
    decode.num_thinking_chunks = 2
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url,))
    status, raw = await post(router, {**CHAT, "stream": True}, rid="think-1")
    assert status == 200
    deltas = [c["delta"] for p in sse_events(raw)[:-1] for c in orjson.loads(p)["choices"]]
    assert [d.get("reasoning_content") for d in deltas if "reasoning_content" in d] == [
        "t0 ", "t1 "
    ]  # fmt: skip
    assert _texts(raw, True) == ["t2 ", "t3 "]
    # Its text offsets are not the worker's raw text: a break is not resumed, it ends the stream.
    decode.die_after_chunks = 3
    d2 = await make_worker("decode")
    router = await make_router(prefill_urls=(prefill.url,), decode_urls=(decode.url, d2.url))
    d2.num_thinking_chunks, d2.die_after_chunks = 2, 3
    status, raw = await post(router, {**CHAT, "stream": True}, rid="think-2")
    assert status == 200 and b"stream_broken" in sse_events(raw)[-2]
    assert router.stats.num_migrations == 0
    assert not [r for d in (decode, d2) for r in d.requests if "resume_params" in r.body]


def test_tracker_takes_token_ids_out_and_keeps_the_first_stream_id():
    tracker = StreamTracker(is_chat=True)
    first = {"id": "a", "created": 1, "choices": [{"delta": {"role": "assistant", "content": ""}}]}
    tok = {"id": "a", "created": 1, "choices": [{"delta": {"content": "hé"}, "token_ids": [5, 6]}]}
    data = b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in (first, tok))
    out = tracker.filter(data + b'data: {"half')  # a trailing partial event is dropped
    assert out.count(b"data: ") == 2 and b"token_ids" not in out and b"half" not in out
    assert tracker.token_ids == [5, 6] and tracker.num_text_chars == 2
    tracker.num_migrations = 1
    again = {"id": "b", "created": 2, "choices": [{"delta": {"role": "assistant", "content": ""}}]}
    more = {"id": "b", "created": 2, "choices": [{"delta": {"content": "x"}, "token_ids": [7]}]}
    empty = {"id": "b", "created": 2, "choices": [{"delta": {}, "token_ids": [8]}]}
    data = b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in (again, more, empty))
    out = tracker.filter(data)
    assert out.count(b"data: ") == 1  # the second role chunk and the empty delta are dropped
    assert orjson.loads(out[6:])["id"] == "a" and orjson.loads(out[6:])["created"] == 1
    assert tracker.token_ids == [5, 6, 7, 8] and tracker.can_resume


def test_tracker_cannot_resume_a_worker_that_does_not_name_its_tokens():
    tracker = StreamTracker(is_chat=False)
    tracker.filter(b'data: {"id": "a", "choices": [{"text": "x"}]}\n\n')
    assert not tracker.can_resume


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"stream": True, "messages": []}, True),
        ({"messages": []}, False),
        ({"stream": True, "messages": [], "n": 2}, False),
        ({"stream": True, "messages": [], "tools": [{"type": "function"}]}, False),
    ],
)
def test_which_chat_requests_may_migrate(body, expected):
    assert is_migratable("/v1/chat/completions", body) is expected


@pytest.mark.parametrize(
    ("prompt", "expected"), [("hi", True), ([1, 2], True), (["a"], True), (["a", "b"], False)]
)
def test_which_completion_requests_may_migrate(prompt, expected):
    assert is_migratable("/v1/completions", {"stream": True, "prompt": prompt}) is expected


def test_tracker_leaves_token_ids_a_client_asked_for():
    tracker = StreamTracker(is_chat=False, keep_token_ids=True)
    tok = {"id": "a", "created": 1, "choices": [{"text": "x", "token_ids": [5]}]}
    tok["choices"][0]["prompt_token_ids"] = [1, 2]
    out = orjson.loads(tracker.filter(b"data: " + orjson.dumps(tok) + b"\n\n")[6:])
    assert out["choices"][0]["token_ids"] == [5] and out["choices"][0]["prompt_token_ids"] == [1, 2]
    assert tracker.token_ids == [5]
    tracker.num_migrations = 1  # the next worker's first chunk: the prompt ids went out already
    out = orjson.loads(tracker.filter(b"data: " + orjson.dumps(tok) + b"\n\n")[6:])
    assert "prompt_token_ids" not in out["choices"][0] and out["choices"][0]["token_ids"] == [5]
    plain = StreamTracker(is_chat=False)
    out = orjson.loads(plain.filter(b"data: " + orjson.dumps(tok) + b"\n\n")[6:])
    assert "token_ids" not in out["choices"][0] and "prompt_token_ids" not in out["choices"][0]
