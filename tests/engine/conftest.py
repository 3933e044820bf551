from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.model.demo import write_demo_model
from pdserve.model_runner import ModelRunner, RunnerConfig


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def runner(demo_dir: Path) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=str(demo_dir), kv_cache_bytes=16 << 20))


@pytest.fixture(scope="session")
def small_runner(demo_dir: Path) -> ModelRunner:
    """A KV cache so small that a few concurrent sequences force preemption."""
    return ModelRunner(RunnerConfig(model_dir=str(demo_dir), page_size=4, num_pages=24))
