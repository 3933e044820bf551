"""Finding the GGUF file a --model path names, and its served name."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.model.checkpoint import default_served_name, load_model_config
from pdserve.model.config import ModelDirError
from pdserve.model.gguf.file import find_gguf, model_name_of


def test_a_directory_holding_one_gguf_file_names_it(demo_f32_gguf: Path) -> None:
    assert find_gguf(demo_f32_gguf) == demo_f32_gguf
    assert find_gguf(demo_f32_gguf.parent) == demo_f32_gguf
    assert load_model_config(demo_f32_gguf.parent).hidden_size == 256


def test_a_hugging_face_directory_is_not_gguf(demo_dir: Path) -> None:
    assert find_gguf(demo_dir) is None


def test_several_gguf_files_in_a_directory_must_be_chosen_between(tmp_path: Path) -> None:
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelDirError, match="several GGUF files"):
        find_gguf(tmp_path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelDirError, match="not a readable GGUF file"):
        load_model_config(bad)
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ModelDirError, match="not a .gguf file"):
        load_model_config(tmp_path / "model.bin")


@pytest.mark.parametrize(
    ("name", "served"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("Qwen2.5-0.5B-Instruct-Q4_K_M.gguf", "Qwen2.5-0.5B-Instruct"),
        ("model-bf16.gguf", "model"),
        ("tinyllama.gguf", "tinyllama"),
    ],
)
def test_the_served_name_drops_the_quantization_suffix(name: str, served: str) -> None:
    assert model_name_of(Path(name)) == served
    assert default_served_name(Path("/nowhere") / name) == served


def test_a_gguf_file_has_a_weights_fingerprint_that_tells_other_weights_apart(
    demo_dir: Path, demo_f32_gguf: Path, tmp_path: Path
) -> None:
    from pdserve.model.fingerprint import weights_fingerprint
    from tests.model.gguf.conftest import demo_gguf

    value = weights_fingerprint(demo_f32_gguf)
    assert len(value) == 16 and weights_fingerprint(demo_f32_gguf.parent) == value
    assert weights_fingerprint(demo_gguf(demo_dir, tmp_path, "Q8_0")) != value
