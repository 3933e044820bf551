"""The weights fingerprint (pdserve/model/fingerprint.py): the same weights give the same value
however they are stored; one architecture with other weights does not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pdserve.model.config import ModelConfig
from pdserve.model.fingerprint import weights_fingerprint
from pdserve.transport.layout import model_fingerprint
from tests.model.checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "base", "llama")


def _retouch(src: Path, dst: Path, name: str, delta: float) -> Path:
    """A copy of ``src`` with ``delta`` added to one tensor (a fine-tune, as far as it goes)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    tensors[name] = tensors[name] + delta
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_a_copy_of_a_checkpoint_has_its_fingerprint(base: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    value = weights_fingerprint(base)
    assert len(value) == 16 and weights_fingerprint(copy) == value


@pytest.mark.parametrize(
    "name",
    ["model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight"],
)
def test_other_weights_of_the_same_architecture_change_it(
    base: Path, tmp_path: Path, name: str
) -> None:
    tuned = _retouch(base, tmp_path / "tuned", name, 0.5)
    # The architecture fingerprint cannot tell them apart: that is why this one exists.
    assert model_fingerprint(ModelConfig.from_dir(tuned)) == model_fingerprint(
        ModelConfig.from_dir(base)
    )
    assert weights_fingerprint(tuned) != weights_fingerprint(base)


def test_a_sharded_checkpoint_is_fingerprinted_across_its_shards(tmp_path: Path) -> None:
    sharded = write_checkpoint(tmp_path / "sharded", "llama", sharded=True)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    other = write_checkpoint(tmp_path / "other", "llama", sharded=True, seed=1)
    assert weights_fingerprint(other) != weights_fingerprint(sharded)
