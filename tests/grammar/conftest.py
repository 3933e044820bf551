"""One demo tokenizer and grammar compiler per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.grammar import GrammarCompiler
from pdserve.model.demo import write_demo_model
from pdserve.model.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path: Path = write_demo_model(tmp_path_factory.mktemp("demo"))
    return Tokenizer.from_dir(path)


@pytest.fixture
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(
        tokenizer.backend.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids
    )
