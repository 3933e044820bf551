"""Tokenizer over a ``tokenizer.json`` (the `tokenizers` library) plus streaming detokenization.

Reads ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, chat template),
``chat_template.jinja`` (transformers 5 keeps the template there), and the eos ids of
``generation_config.json`` / ``config.json``. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from pdserve.model.chat_template import ChatTemplateError, render_chat_template
from pdserve.model.config import ModelDirError

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_str(value: Any) -> str | None:
    # tokenizer_config stores special tokens as strings or as {"content": ...} dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def _chat_template(root: Path, tok_cfg: dict[str, Any]) -> str | None:
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


class Tokenizer:
    """Text <-> token ids, special tokens, and chat templates for one model directory."""

    def __init__(
        self,
        backend: HFTokenizer,
        special_tokens: dict[str, str],
        extra_eos_ids: set[int] | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self.backend = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._token_id(special_tokens.get("bos_token"))
        eos = set(extra_eos_ids or ())
        eos_id = self._token_id(special_tokens.get("eos_token"))
        if eos_id is not None:
            eos.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self._add_bos_token = add_bos_token and self.bos_token_id is not None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory (``tokenizer.json`` is required)."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelDirError(
                f"tokenizer.json missing in model directory {str(root)!r} "
                "(only fast tokenizers are supported)"
            )
        tok_cfg = _json(root / "tokenizer_config.json")
        specials = {k: s for k in _SPECIAL_KEYS if (s := _token_str(tok_cfg.get(k)))}
        eos = _ids(_json(root / "generation_config.json").get("eos_token_id"))
        eos |= _ids(_json(root / "config.json").get("eos_token_id"))
        return cls(
            HFTokenizer.from_file(str(tok_file)),
            specials,
            extra_eos_ids=eos,
            chat_template=_chat_template(root, tok_cfg),
            add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
        )

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens (e.g. BOS) per the tokenizer's post-processor."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]  # type: ignore[list-item]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; an incomplete UTF-8 sequence at the end decodes to U+FFFD."""
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render a conversation to prompt text; encode it with ``add_special_tokens=False``."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template")
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt, self.special_tokens, **extra
        )


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    Decodes only a short window of ids: the tokens since the last emitted text plus a few before
    them for context (word-boundary spaces depend on the previous token). Text ending in U+FFFD
    is held back until the next tokens complete the character.
    """

    CONTEXT_TOKENS = 5
    MAX_HELD_TOKENS = 16  # give up waiting for a real (model-made) broken sequence
    _TRIM_AT = 64

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-self.CONTEXT_TOKENS :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def step(self, new_ids: list[int]) -> str:
        """Append ``new_ids``; return the text they complete (may be empty)."""
        self._ids.extend(new_ids)
        prefix_text, full_text = self._decode_window()
        is_complete = not full_text.endswith("\ufffd")
        num_held = len(self._ids) - self._read_offset
        if len(full_text) > len(prefix_text) and (is_complete or num_held > self.MAX_HELD_TOKENS):
            return self._advance(full_text[len(prefix_text) :])
        return ""

    def flush(self) -> str:
        """Text still held back at the end of the stream (may contain U+FFFD)."""
        prefix_text, full_text = self._decode_window()
        if len(full_text) > len(prefix_text):
            return self._advance(full_text[len(prefix_text) :])
        return ""

    def _decode_window(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset :]
        num_prefix = self._read_offset - self._prefix_offset
        decode = self._tokenizer.decode
        return decode(window[:num_prefix], self._skip_special), decode(window, self._skip_special)

    def _advance(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # Drop ids that can no longer be in a window, keeping work per token O(1).
        if self._prefix_offset > self._TRIM_AT:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta
