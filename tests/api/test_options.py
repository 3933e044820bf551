from __future__ import annotations

import pytest

from pdserve.api.config import ApiConfig
from pdserve.api.errors import ApiError
from pdserve.api.options import is_valid_id, parse_kv_transfer, parse_options
from pdserve.engine.protocol import KVTransferParams

CONFIG = ApiConfig(served_model_name="m", max_n=4, max_stop_strings=3, max_stop_len=5)
VOCAB = 257


def _chat(**body: object):
    return parse_options(body, CONFIG, VOCAB, is_chat=True)


def _completion(**body: object):
    return parse_options(body, CONFIG, VOCAB, is_chat=False)


def test_defaults_when_fields_absent_or_null() -> None:
    opts = _chat(temperature=None, top_p=None, n=None, stop=None, seed=None)
    assert (opts.temperature, opts.top_p, opts.top_k, opts.n) == (1.0, 1.0, 0, 1)
    assert opts.max_tokens is None and opts.stop == [] and opts.seed is None
    assert not opts.stream and not opts.logprobs and opts.kv_transfer is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("n", 0),
        ("n", 5),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("seed", 2**63),
        ("max_tokens", 1.5),
        ("n", True),
        ("temperature", "0.5"),
        ("ignore_eos", 1),
        ("stream", "true"),
    ],
)
def test_out_of_range_or_mistyped_values_are_400_naming_the_field(
    field: str, value: object
) -> None:
    with pytest.raises(ApiError) as info:
        _chat(**{field: value})
    assert info.value.status == 400 and info.value.param == field


def test_max_completion_tokens_wins_over_max_tokens_in_chat() -> None:
    assert _chat(max_tokens=5, max_completion_tokens=7).max_tokens == 7
    assert _chat(max_tokens=5).max_tokens == 5
    with pytest.raises(ApiError) as info:
        _chat(max_completion_tokens=0)
    assert info.value.param == "max_completion_tokens"


def test_stop_accepts_string_or_list_within_limits() -> None:
    assert _chat(stop="\n").stop == ["\n"]
    assert _chat(stop=["a", "bb"]).stop == ["a", "bb"]
    with pytest.raises(ApiError, match="Too many stop sequences: 4, the maximum is 3"):
        _chat(stop=["a", "b", "c", "d"])
    with pytest.raises(ApiError, match="too long: 6 characters"):
        _chat(stop=["abcdef"])
    with pytest.raises(ApiError) as info:
        _chat(stop=[""])
    assert info.value.param == "stop[0]"
    with pytest.raises(ApiError):
        _chat(stop=[1])


def test_stop_token_ids_must_be_in_vocabulary() -> None:
    assert _chat(stop_token_ids=[0, 256]).stop_token_ids == [0, 256]
    with pytest.raises(ApiError):
        _chat(stop_token_ids=[257])


def test_chat_logprobs_rules() -> None:
    opts = _chat(logprobs=True, top_logprobs=3)
    assert opts.logprobs and opts.top_logprobs == 3
    with pytest.raises(ApiError, match="requires 'logprobs'"):
        _chat(top_logprobs=2)
    with pytest.raises(ApiError):
        _chat(logprobs=True, top_logprobs=CONFIG.max_top_logprobs + 1)
    with pytest.raises(ApiError):
        _chat(logprobs=1)  # chat logprobs is a boolean


def test_completion_logprobs_is_a_count_and_zero_still_enables() -> None:
    opts = _completion(logprobs=0)
    assert opts.logprobs and opts.top_logprobs == 0
    assert _completion(logprobs=2).top_logprobs == 2
    with pytest.raises(ApiError):
        _completion(logprobs=True)


def test_stream_options_only_with_stream_and_known_keys() -> None:
    assert _chat(stream=True, stream_options={"include_usage": True}).include_usage
    with pytest.raises(ApiError, match="only allowed when 'stream' is enabled"):
        _chat(stream_options={"include_usage": True})
    with pytest.raises(ApiError, match="Unrecognized request argument supplied: stream_options.x"):
        _chat(stream=True, stream_options={"x": 1})


def test_each_choice_gets_its_own_seed() -> None:
    opts = _chat(seed=41, n=3)
    assert [opts.sampling_params(8, i).seed for i in range(3)] == [41, 42, 43]
    assert _chat().sampling_params(8, 2).seed is None


def test_sampling_params_carry_every_option() -> None:
    opts = _chat(
        temperature=0.0,
        top_p=0.5,
        top_k=7,
        stop=["x"],
        stop_token_ids=[3],
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=2,
    )
    sp = opts.sampling_params(9, 0)
    assert sp.max_tokens == 9 and sp.is_greedy and sp.top_p == 0.5 and sp.top_k == 7
    assert sp.stop == ["x"] and sp.stop_token_ids == [3] and sp.ignore_eos
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.2)
    assert sp.logprobs and sp.top_logprobs == 2


def test_kv_transfer_params_parse_and_validate() -> None:
    kv = parse_kv_transfer({"room_id": "r1", "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998})
    assert kv == KVTransferParams("r1", "127.0.0.1", 8998)
    bad = [
        {"room_id": "r1", "bootstrap_host": "h"},
        {"room_id": "has space", "bootstrap_host": "h", "bootstrap_port": 1},
        {"room_id": "r", "bootstrap_host": "", "bootstrap_port": 1},
        {"room_id": "r", "bootstrap_host": "h", "bootstrap_port": 70000},
        {"room_id": "r", "bootstrap_host": "h", "bootstrap_port": 1, "extra": 1},
        ["r", "h", 1],
    ]
    for value in bad:
        with pytest.raises(ApiError) as info:
            parse_kv_transfer(value)
        assert info.value.param.startswith("kv_transfer_params")


def test_id_format() -> None:
    assert is_valid_id("cmpl-abc_1.2:3")
    assert not is_valid_id("")
    assert not is_valid_id("a" * 129)
    assert not is_valid_id("a/b")
