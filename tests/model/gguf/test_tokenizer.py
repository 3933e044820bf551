"""The GGUF tokenizer against transformers' GGUF tokenizer of the same file, and on SmolLM2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.model.checkpoint import load_tokenizer
from pdserve.model.tokenizer import Tokenizer
from tests.model.gguf.writer import write_sentencepiece_vocab_gguf

TEXTS = [
    "Hello, world!",
    "  leading spaces and a run of     five, tabs\t\there\n\n\nand newlines\r\n",
    "digits 0 12 345 6789 3.14159 1e-9 2024-12-02",
    "naïve café — 東京 — Ελληνικά — кириллица — emoji 🙂🚀 — ZWJ 👩‍💻",
    "def main(argv):\n    return {'a': [1, 2]}  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text with </s> and <s> special tokens inside",
    "",
    " ",
    "don't won't we're I'll you've",
]


@pytest.fixture(scope="module")
def pair(demo_f32_gguf: Path) -> tuple[Tokenizer, Any]:
    from transformers import AutoTokenizer

    path = demo_f32_gguf
    return load_tokenizer(path), AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name
    )


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers_gguf_tokenizer(
    pair: tuple[Tokenizer, Any], text: str
) -> None:
    ours, theirs = pair
    ids = ours.encode(text)
    assert ids == theirs(text)["input_ids"]
    assert ids[0] == ours.bos_token_id  # the file says add_bos_token
    plain = ours.encode(text, add_special_tokens=False)
    assert plain == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(plain, skip_special_tokens=False) == text
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_stop_ids_come_from_the_file(pair: tuple[Tokenizer, Any]) -> None:
    ours, _ = pair
    assert ours.special_tokens["bos_token"] == "<s>"
    eos, im_end = ours.token_to_id("</s>"), ours.token_to_id("<|im_end|>")
    # The demo's generation config stops on both; the writer stores them as eos and eot.
    assert ours.eos_token_ids == {eos, im_end}
    assert ours.encode("<|im_end|>", add_special_tokens=False) == [im_end]


def test_chat_template_renders_as_transformers_gguf_tokenizer(
    pair: tuple[Tokenizer, Any],
) -> None:
    ours, theirs = pair
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 🙂"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again?"},
    ]
    for add in (True, False):
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected


def test_smollm2_tokenizer_splits_digits_and_renders_its_chatml_template(
    smollm_gguf: Path,
) -> None:
    tok = load_tokenizer(smollm_gguf)
    assert tok.vocab_size == 49152
    assert tok.special_tokens["eos_token"] == "<|im_end|>" and tok.eos_token_ids == {2}
    assert tok.encode("Hi") == tok.encode("Hi", add_special_tokens=False)  # no BOS added
    # llama.cpp's "smollm" pre-tokenizer (like the model's own tokenizer.json) splits every
    # digit; GPT-2's split would keep "2024" together.
    digits = tok.encode("2024", add_special_tokens=False)
    assert [tok.decode([i]) for i in digits] == ["2", "0", "2", "4"]
    for text in TEXTS:
        if not any(c.isdigit() for c in text):
            assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.encode(prompt, add_special_tokens=False)[:2] == [1, 9690]  # <|im_start|> system


def test_sentencepiece_vocabulary_matches_transformers_gguf_tokenizer(tmp_path: Path) -> None:
    """``tokenizer.ggml.model`` "llama" (Llama 2 / Mistral): byte fallback, merges recovered
    from the scores, a prefix space added."""
    from transformers import AutoTokenizer

    corpus = (Path(__file__).resolve().parents[3] / "README.md").read_text(encoding="utf-8")
    path = write_sentencepiece_vocab_gguf(tmp_path / "spm.gguf", corpus)
    ours = load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        if not text.startswith(" "):  # sentencepiece decoding drops one leading space
            plain = ours.encode(text, add_special_tokens=False)
            assert ours.decode(plain, skip_special_tokens=False) == text
    assert ours.encode("Hi")[0] == 1  # BOS, as llama.cpp adds to sentencepiece vocabularies
    assert any(ours.backend.id_to_token(i).startswith("<0x") for i in ours.encode("東京"))
