"""Prompt sets of bench/serving.py: random words, shared prefixes, multi-turn chat.

* ``random``: ``num_requests`` independent prompts of ``input_len`` words (or tokens).
* ``prefix_repetition`` (vLLM's ``--dataset-name prefix_repetition`` shape): ``num_prefixes``
  groups, each a ``prefix_len`` prefix shared by its requests plus ``input_len`` unique words;
  requests cycle through the groups, so concurrent ones hit different prefixes.
* ``multi_turn``: ``num_requests // num_turns`` conversations of ``num_turns`` user turns of
  ``input_len`` words; turn t resends turns 0..t-1 with a synthetic ``output_len``-word assistant
  reply each (not the model's answer: the requests stay independent and reproducible). Sent
  turn-major, so a conversation's next turn comes after the other conversations' current one.

Lengths are in words, or in tokens when a tokenizer is given (random and prefix_repetition).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

DATASETS = ("random", "prefix_repetition", "multi_turn")
MAX_PROMPT_DOUBLINGS = 8  # x256 the words: a tokenizer still short of input_len never will be

Prompt = str | list[dict[str, str]]  # a text, or chat messages


class Words:
    """Deterministic made-up words drawn from a seed."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "pe", "da", "zu", "ri"]
        self.vocab = [
            "".join(self.rng.choices(syllables, k=self.rng.randint(1, 3))) for _ in range(2000)
        ]

    def text(self, num_words: int) -> str:
        return " ".join(self.rng.choices(self.vocab, k=num_words))


def make_prompts(
    dataset: str,
    num_requests: int,
    input_len: int,
    *,
    seed: int = 0,
    tokenizer: str | None = None,
    num_prefixes: int = 16,
    prefix_len: int = 1024,
    num_turns: int = 4,
    output_len: int = 128,
) -> list[Prompt]:
    words = Words(seed)
    tok = _load_tokenizer(tokenizer) if tokenizer else None  # once: a 32k vocab takes ~65 ms

    def fit(text: str, n: int) -> str:
        return _fit_to_tokens(text, tok, n, str(tokenizer)) if tok is not None else text

    if dataset == "random":
        return [fit(words.text(input_len), input_len) for _ in range(num_requests)]
    if dataset == "prefix_repetition":
        prefixes = [fit(words.text(prefix_len), prefix_len) for _ in range(num_prefixes)]
        return [
            f"{prefixes[i % num_prefixes]} {fit(words.text(input_len), input_len)}"
            for i in range(num_requests)
        ]
    if dataset == "multi_turn":
        return _multi_turn(words, max(1, num_requests // num_turns), num_turns, input_len,
                           output_len)  # fmt: skip
    raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")


def _multi_turn(
    words: Words, num_conversations: int, num_turns: int, turn_len: int, reply_len: int
) -> list[Prompt]:
    turns = [
        [(words.text(turn_len), words.text(reply_len)) for _ in range(num_turns)]
        for _ in range(num_conversations)
    ]
    out: list[Prompt] = []
    for t in range(num_turns):
        for conv in turns:
            messages: list[dict[str, str]] = []
            for user, reply in conv[:t]:
                messages += [{"role": "user", "content": user},
                             {"role": "assistant", "content": reply}]  # fmt: skip
            messages.append({"role": "user", "content": conv[t][0]})
            out.append(messages)
    return out


def _load_tokenizer(path_or_dir: str) -> Any:
    from tokenizers import Tokenizer  # noqa: PLC0415 - only when exact lengths are asked for

    path = Path(path_or_dir)
    return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))


def _fit_to_tokens(prompt: str, tok: Any, input_len: int, path: str) -> str:
    ids = tok.encode(prompt, add_special_tokens=False).ids
    for _ in range(MAX_PROMPT_DOUBLINGS):  # some tokenizers merge words: pad with more words
        if len(ids) >= input_len:
            return tok.decode(ids[:input_len])
        prompt = f"{prompt} {prompt}"
        ids = tok.encode(prompt, add_special_tokens=False).ids
    raise ValueError(
        f"{path}: {len(ids)} tokens from {len(prompt)} characters of words; this tokenizer cannot "
        f"make {input_len}-token prompts (e.g. a word-level vocabulary without a pre-tokenizer)"
    )
