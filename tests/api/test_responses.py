from __future__ import annotations

from pdserve.api.logprobs import TokenTexts
from pdserve.api.options import RequestOptions
from pdserve.api.prepare import PreparedRequest
from pdserve.api.responses import ChatResponseBuilder, CompletionResponseBuilder
from pdserve.engine.protocol import GenerateOutput, GenerateRequest, TokenLogprob
from pdserve.sampling_params import SamplingParams

from .engine_double import ByteTokenizer

TEXTS = TokenTexts(ByteTokenizer())


def _prepared(num_choices: int = 1, prompt_lens: list[int] | None = None, **opts: object):
    return PreparedRequest(
        request_id="rid",
        model="m",
        created=1700000000,
        options=RequestOptions(**opts),  # type: ignore[arg-type]
        prompt_lens=prompt_lens or [5],
        engine_requests=[
            GenerateRequest(f"rid-{i}", [1] * 5, SamplingParams()) for i in range(num_choices)
        ],
    )


def _out(text: str, generated: int, finish: str | None = None, logprobs=None) -> GenerateOutput:
    ids = list(text.encode())
    return GenerateOutput("rid", ids, text, 5, generated, finish, logprobs)


def test_chat_stream_opens_with_role_then_content_then_finish() -> None:
    builder = ChatResponseBuilder(_prepared(num_choices=2), TEXTS)
    opening = builder.opening_chunks()
    assert [c["choices"][0]["index"] for c in opening] == [0, 1]
    assert opening[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert opening[0]["object"] == "chat.completion.chunk" and "usage" not in opening[0]
    middle = builder.chunk(1, _out("he", 2))
    assert middle["choices"] == [
        {"index": 1, "delta": {"content": "he"}, "logprobs": None, "finish_reason": None}
    ]
    last = builder.chunk(1, _out("", 3, "stop"))
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    assert {k: middle[k] for k in ("id", "created", "model")} == {
        "id": "rid",
        "created": 1700000000,
        "model": "m",
    }


def test_empty_deltas_produce_no_chunk() -> None:
    builder = ChatResponseBuilder(_prepared(), TEXTS)
    assert builder.chunk(0, _out("", 1)) is None
    assert CompletionResponseBuilder(_prepared(), TEXTS).chunk(0, _out("", 1)) is None


def test_usage_counts_each_prompt_once_and_sums_completions() -> None:
    builder = CompletionResponseBuilder(_prepared(num_choices=4, prompt_lens=[5, 7], n=2), TEXTS)
    for i, generated in enumerate([3, 4, 5, 6]):
        builder.add(i, _out("x" * generated, generated, "length"))
    assert builder.usage() == {
        "prompt_tokens": 12, "completion_tokens": 18, "total_tokens": 30,
        "prompt_tokens_details": {"cached_tokens": 0},
    }  # fmt: skip
    response = builder.response()
    assert response["object"] == "text_completion"
    assert [c["index"] for c in response["choices"]] == [0, 1, 2, 3]
    assert response["choices"][2] == {
        "index": 2,
        "text": "xxxxx",
        "logprobs": None,
        "finish_reason": "length",
    }


def test_cached_tokens_count_each_prompt_once() -> None:
    builder = CompletionResponseBuilder(_prepared(num_choices=4, prompt_lens=[5, 7], n=2), TEXTS)
    for i, cached in enumerate([4, 4, 0, 4]):
        out = _out("x", 1, "length")
        out.num_cached_tokens = cached
        builder.add(i, out)
    assert builder.usage()["prompt_tokens_details"] == {"cached_tokens": 8}


def test_include_usage_sets_null_usage_on_chunks_and_a_final_usage_chunk() -> None:
    builder = ChatResponseBuilder(_prepared(stream=True, include_usage=True), TEXTS)
    chunk = builder.chunk(0, _out("a", 1, "length"))
    assert "usage" in chunk and chunk["usage"] is None
    final = builder.usage_chunk()
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 1


def test_non_streaming_chat_joins_text_and_logprobs() -> None:
    builder = ChatResponseBuilder(_prepared(logprobs=True), TEXTS)
    builder.add(0, _out("h", 1, logprobs=[TokenLogprob(104, -0.5)]))
    builder.add(0, _out("i", 2, "stop", logprobs=[TokenLogprob(105, -0.25)]))
    (choice,) = builder.response()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "hi"}
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["h", "i"]
    assert choice["finish_reason"] == "stop"


def test_streamed_completion_logprob_offsets_follow_the_choice() -> None:
    builder = CompletionResponseBuilder(_prepared(num_choices=2, logprobs=True), TEXTS)
    a = builder.chunk(0, _out("ab", 2, logprobs=[TokenLogprob(97, -1), TokenLogprob(98, -1)]))
    b = builder.chunk(1, _out("z", 1, logprobs=[TokenLogprob(122, -1)]))
    c = builder.chunk(0, _out("c", 3, "length", logprobs=[TokenLogprob(99, -1)]))
    assert a["choices"][0]["logprobs"]["text_offset"] == [0, 1]
    assert b["choices"][0]["logprobs"]["text_offset"] == [0]
    assert c["choices"][0]["logprobs"]["text_offset"] == [2]
