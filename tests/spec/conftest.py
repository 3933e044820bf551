"""The demo pair: the demo checkpoint as the target, a second random one (another seed, half
the layers, the same tokenizer) as the draft, so acceptance is low and rollback runs often."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.model.demo import DemoShape, write_demo_model
from pdserve.model_runner import ModelRunner, RunnerConfig

PAGE = 4


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("draft"), DemoShape(seed=7, num_layers=2))


@pytest.fixture(scope="session")
def target(demo_dir: Path) -> ModelRunner:
    return ModelRunner(RunnerConfig(str(demo_dir), page_size=PAGE, num_pages=512))
