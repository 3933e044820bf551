"""Recorded-format outputs (tests/data/reasoning) and the Qwen3-architecture thinking demo."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.model.demo import DemoShape, write_demo_model

DATA = Path(__file__).parent.parent / "data" / "reasoning" / "outputs.json"


def output_cases() -> list[dict[str, Any]]:
    return json.loads(DATA.read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="session")
def thinking_demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("thinking-demo"), DemoShape(thinking=True))
