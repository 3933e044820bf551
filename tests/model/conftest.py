"""Shared fixtures for model tests: one demo model per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.model.demo import write_demo_model


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo"))
