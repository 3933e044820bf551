"""The text split: thinking and answer right for every recorded-format output, fed whole or in
any chunking, and never a piece of a tag in either part."""

from __future__ import annotations

import random

import pytest

from pdserve.reasoning.parser import PARSERS, ReasoningSplitter

from .conftest import output_cases

CASES = output_cases()
FORMATS = sorted(PARSERS)


def _streamed(fmt_name: str, starts: bool, pieces: list[str]) -> tuple[str, str, list[str]]:
    splitter = ReasoningSplitter(PARSERS[fmt_name], starts)
    thought, answer, emitted = "", "", []
    for piece in pieces:
        t, a = splitter.feed(piece)
        thought, answer = thought + t, answer + a
        emitted += [t, a]
    t, a = splitter.finish()
    return thought + t, answer + a, emitted + [t, a]


def _chunkings(text: str, seed: int) -> list[list[str]]:
    """Every one- and two-cut split, one character at a time, and random splits."""
    n = len(text)
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(1, n)]
    out += [[text[:i], text[i:j], text[j:]] for i in range(1, n, 3) for j in range(i + 1, n, 5)]
    rng = random.Random(seed)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)])
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_a_whole_output_splits_into_its_thinking_and_its_answer(case, fmt) -> None:
    splitter = ReasoningSplitter(PARSERS[fmt], case["starts_thinking"])
    assert splitter.split(case["text"]) == (case["reasoning"], case["content"])


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_every_chunking_streams_the_same_split(case) -> None:
    expected = (case["reasoning"], case["content"])
    for pieces in _chunkings(case["text"], seed=len(case["text"])):
        thought, answer, _ = _streamed("qwen3", case["starts_thinking"], pieces)
        assert (thought, answer) == expected, pieces


def test_a_partial_closing_tag_is_held_until_it_completes() -> None:
    splitter = ReasoningSplitter(PARSERS["qwen3"], is_thinking=True)
    assert splitter.feed("<thi") == ("", "")  # maybe the opening tag
    assert splitter.feed("nk>plan </th") == ("plan ", "")  # maybe the closing tag
    assert splitter.feed("ink>\n") == ("", "")  # closed; the whitespace after it dropped
    assert splitter.feed("\nDone") == ("", "Done")
    assert not splitter.is_thinking


def test_a_partial_tag_that_never_completes_is_text_at_the_end() -> None:
    splitter = ReasoningSplitter(PARSERS["deepseek_r1"], is_thinking=True)
    assert splitter.feed("a </thin") == ("a ", "")
    assert splitter.finish() == ("</thin", "")


def test_an_answer_with_no_thinking_block_streams_as_it_comes() -> None:
    splitter = ReasoningSplitter(PARSERS["qwen3"], is_thinking=False)
    assert splitter.feed("<think") == ("", "<think")  # no block here: not held back
    assert splitter.feed("> x </think>") == ("", "> x </think>")
