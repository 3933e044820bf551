"""The tokenizer a GGUF file describes, rebuilt from its ``tokenizer.ggml.*`` metadata.

Two vocabulary kinds (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE with the file's merges, split the way ``tokenizer.ggml.pre`` names
  (llama.cpp's pre-tokenizer names; an unknown one falls back to GPT-2's split, with a warning);
- ``llama``: sentencepiece BPE with byte fallback, merges recovered from the token scores.

Control tokens (type 3) become special tokens and user-defined ones (type 4) added tokens, so
both are matched whole in text. The chat template is ``tokenizer.chat_template``.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from pdserve.model.config import ModelDirError
from pdserve.model.gguf.config import stop_token_ids
from pdserve.model.gguf.file import GGUFFile
from pdserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
_SPECIAL_IDS = {
    "bos_token": "bos",
    "eos_token": "eos",
    "unk_token": "unknown",
    "pad_token": "padding",
}

# Split patterns of llama.cpp's pre-tokenizer names (the same ones the models' own
# tokenizer.json files use).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3")
_SPLITS = dict.fromkeys(_LLAMA3_NAMES, _LLAMA3)
_SPLITS |= dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2)
_GPT2_NAMES = ("default", "gpt2", "gpt-2")
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact")  # each digit its own piece, then GPT-2's


def gguf_tokenizer(f: GGUFFile) -> Tokenizer:
    """pdserve's :class:`Tokenizer` over the vocabulary stored in ``f``."""
    kind = f.value("tokenizer.ggml.model", None)
    tokens: list[str] = f.value("tokenizer.ggml.tokens")
    token_types: list[int] = f.value("tokenizer.ggml.token_type", [])
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, f.value("tokenizer.ggml.merges", []))
        backend.pre_tokenizer = _byte_level_split(f.value("tokenizer.ggml.pre", "default"))
    elif kind == "llama":
        add_prefix = bool(f.value("tokenizer.ggml.add_space_prefix", True))
        backend = _sentencepiece_bpe(tokens, f.value("tokenizer.ggml.scores"), add_prefix)
    else:
        raise ModelDirError(
            f"{f.path.name}: unsupported tokenizer.ggml.model {kind!r} (gpt2, llama)"
        )
    _add_special_tokens(backend, tokens, token_types)
    specials = {}
    for name, key in _SPECIAL_IDS.items():
        token_id = f.value(f"tokenizer.ggml.{key}_token_id", None)
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            specials[name] = tokens[token_id]
    # llama.cpp adds BOS to sentencepiece vocabularies unless the file says otherwise.
    add_bos = bool(f.value("tokenizer.ggml.add_bos_token", kind == "llama"))
    return Tokenizer(
        backend,
        specials,
        extra_eos_ids=stop_token_ids(f),
        chat_template=f.value("tokenizer.chat_template", None),
        add_bos_token=add_bos,
    )


def _byte_level_bpe(tokens: list[str], merges: list[str]) -> HFTokenizer:
    # Vocabulary entries are spelled in GPT-2's byte alphabet; any that is not (an added token
    # with other characters) is re-spelled from its UTF-8 bytes, as the BPE model looks it up.
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {
        (t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = models.BPE(vocab, pairs, continuing_subword_prefix="", end_of_word_suffix="",
                       fuse_unk=False)  # fmt: skip
    backend = HFTokenizer(model)
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_split(pre: str) -> Any:
    split = _SPLITS.get(pre)
    if split is not None:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in _GPT2_NAMES:
        logger.warning("GGUF pre-tokenizer %r unknown: splitting text as GPT-2 does", pre)
    return gpt2


def _sentencepiece_bpe(tokens: list[str], scores: list[float], add_prefix: bool) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(vocab, _merges_from_scores(vocab, scores), unk_token=tokens[0],
                       fuse_unk=True, byte_fallback=True)  # fmt: skip
    backend = HFTokenizer(model)
    scheme = "first" if add_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme,
                                                     split=False)  # fmt: skip
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Sentencepiece stores no merges: every split of a token into two vocabulary tokens is
    one, ranked by the merged token's score (higher first), then by the pieces' lengths."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, token_id in vocab.items():
        score = scores[token_id]
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort(key=lambda r: (r[0], -len(r[3]), -len(r[4]), r[1], r[2]))
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(backend: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    control = [t for t, kind in zip(tokens, types, strict=False) if kind == CONTROL]
    user = [t for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED]
    if control:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling
