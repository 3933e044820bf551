"""GGUF files for the tests, written from the demo checkpoint (and tiny Qwen checkpoints) with
gguf's writer and quantizers; the fetched SmolLM2 file for the real-model tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from tests.model.gguf.writer import write_gguf
from tests.real_models import SMOLLM2, real_model


def demo_gguf(demo_dir: Path, out_dir: Path, qtype: str, **kwargs: object) -> Path:
    """The demo model as ``<out_dir>/demo.<qtype>.gguf`` (a directory of its own, as
    transformers' ``from_pretrained(dir, gguf_file=...)`` wants)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"demo.{qtype}.gguf"
    return write_gguf(demo_dir, path, GGMLQuantizationType[qtype], **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def demo_f32_gguf(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_gguf(demo_dir, tmp_path_factory.mktemp("gguf-f32"), "F32")


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """The real default model (fetched into ~/.cache/pdserve/models if it is not there yet)."""
    return real_model(SMOLLM2)
