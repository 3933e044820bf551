"""The speculator an engine's configuration asks for."""

from __future__ import annotations

from pathlib import Path

from pdserve.kernels.kv_cache import PageAllocator
from pdserve.model_runner import ModelRunner
from pdserve.spec.config import SpeculativeConfig
from pdserve.spec.draft import DraftProposer
from pdserve.spec.proposer import NgramProposer, Proposer
from pdserve.spec.speculator import Speculator


def build_speculator(
    config: SpeculativeConfig, runner: ModelRunner, allocator: PageAllocator, max_model_len: int
) -> Speculator:
    proposer: Proposer
    if config.method == "ngram":
        proposer = NgramProposer(config)
    else:
        if not Path(str(config.draft_model)).exists():
            raise ValueError(f"speculative model {config.draft_model!r} does not exist")
        proposer = DraftProposer(config, runner)
    page_size = runner.kv_config.page_size
    return Speculator(config, proposer, allocator, page_size, max_model_len)
