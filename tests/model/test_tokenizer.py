"""Tokenizer and IncrementalDetokenizer, checked against `transformers` and full decodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.model.config import ModelDirError
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "def hello(world):\n    return world * 2\n",
    "naïve café — 東京タワー 🙂🚀 mixed scripts: Ελληνικά, русский",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(demo_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(demo_dir: Path):  # noqa: ANN201 - transformers type
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(
    tokenizer: Tokenizer, hf_tokenizer, text: str
) -> None:
    for special in (True, False):
        ids = tokenizer.encode(text, add_special_tokens=special)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=special)
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert tokenizer.decode(ids) == text


def test_special_token_ids_come_from_tokenizer_and_generation_configs(tokenizer: Tokenizer) -> None:
    eos = {tokenizer.token_to_id("</s>"), tokenizer.token_to_id("<|im_end|>")}
    assert tokenizer.eos_token_ids == frozenset(eos)
    assert tokenizer.bos_token_id == tokenizer.token_to_id("<s>")
    assert tokenizer.encode("x")[0] == tokenizer.bos_token_id


def test_chat_template_matches_transformers(tokenizer: Tokenizer, hf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 🙂"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And?"},
    ]
    for gen_prompt in (True, False):
        ours = tokenizer.apply_chat_template(messages, add_generation_prompt=gen_prompt)
        ref = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=gen_prompt, tokenize=False
        )
        assert ours == ref
    assert ours.startswith("<s><|im_start|>system\nBe brief.<|im_end|>\n")


def test_missing_tokenizer_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def _stream(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    return [detok.step([i]) for i in ids]


@pytest.mark.parametrize("text", TEXTS[:2])
def test_streamed_deltas_concatenate_to_full_decode(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("Prompt: ")
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(tokenizer, prompt, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_is_held_until_complete(tokenizer: Tokenizer) -> None:
    # One byte-level token per UTF-8 byte of the emoji: nothing may be emitted until the last.
    byte_ids = [tokenizer.token_to_id(_byte_token(b)) for b in "🙂".encode()]
    assert None not in byte_ids
    deltas = _stream(tokenizer, tokenizer.encode("a"), byte_ids)
    assert deltas == ["", "", "", "🙂"]


def test_flush_returns_a_held_back_incomplete_character(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [])
    first_byte = tokenizer.token_to_id(_byte_token("🙂".encode()[0]))
    assert detok.step([first_byte]) == ""
    assert detok.flush() == "\ufffd"


def test_window_stays_small_on_long_streams(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXTS[0] * 40, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    text = "".join(detok.step([i]) for i in ids)
    assert text == TEXTS[0] * 40
    assert len(detok._ids) <= IncrementalDetokenizer._TRIM_AT + 8


def _byte_token(byte: int) -> str:
    # GPT-2 byte-to-unicode table, as used by the ByteLevel pre-tokenizer.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))
