"""tests/real_models.py: a real model a test cannot fetch fails it, unless PDSERVE_OFFLINE=1
says to skip (offline development)."""

from __future__ import annotations

from pathlib import Path

import pytest

import tests.real_models as rm
from pdserve.model.fetch import FetchError


def test_a_model_that_cannot_be_fetched_fails_the_test_unless_offline_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[str] = []

    def unreachable(models_dir: Path | None = None, name: str = "") -> Path:
        asked.append(name)
        raise FetchError("registry unreachable")

    monkeypatch.setattr(rm, "fetch_model", unreachable)
    monkeypatch.delenv("PDSERVE_OFFLINE", raising=False)
    with pytest.raises(FetchError, match="registry unreachable"):
        rm.real_model(rm.QWEN_05B)
    monkeypatch.setenv("PDSERVE_OFFLINE", "1")
    with pytest.raises(pytest.skip.Exception, match="PDSERVE_OFFLINE=1"):
        rm.real_model(rm.QWEN_15B)
    assert asked == [rm.QWEN_05B, rm.QWEN_15B]  # fetched by name, as fetch-model --name


def test_a_fetched_model_is_its_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(rm, "fetch_model", lambda models_dir=None, name="": tmp_path / name)
    assert rm.real_model(rm.SMOLLM2) == tmp_path / "smollm2-135m-instruct"
