"""The speculator an engine's configuration asks for."""

from __future__ import annotations

from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.kernels.kv_cache import PageAllocator
from pdserve.model_runner import ModelRunner
from pdserve.spec.config import SpeculativeConfig
from pdserve.spec.draft import DraftProposer
from pdserve.spec.proposer import NgramProposer, Proposer
from pdserve.spec.speculator import Speculator


def speculator_for(
    engine: EngineConfig, runner: ModelRunner, allocator: PageAllocator, max_model_len: int
) -> Speculator | None:
    """The engine's speculator; None without speculation, and on the prefill role (it runs no
    decode steps)."""
    if engine.speculative is None or engine.role == "prefill":
        return None
    return build_speculator(engine.speculative, runner, allocator, max_model_len)


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
