"""Weight loading: sharded == single file, fused projections, and named failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.model.config import ModelConfig, ModelDirError
from pdserve.model.loader import load_weights, stored_dtype
from tests.model.checkpoints import convert_checkpoint, write_checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return write_checkpoint(root / "single", "qwen2"), write_checkpoint(
        root / "sharded", "qwen2", sharded=True
    )


def test_sharded_and_single_file_checkpoints_load_identically(pair: tuple[Path, Path]) -> None:
    single, sharded = pair
    assert (sharded / "model.safetensors.index.json").is_file()
    cfg = ModelConfig.from_dir(single)
    a = load_weights(single, cfg, torch.float32)
    b = load_weights(sharded, cfg, torch.float32)
    assert torch.equal(a.layers[1].qkv, b.layers[1].qkv)
    assert a.layers[1].qkv_bias is not None and b.layers[1].qkv_bias is not None
    assert torch.equal(a.layers[1].qkv_bias, b.layers[1].qkv_bias)
    assert torch.equal(a.embed, b.embed)


def test_projections_are_fused_in_hf_order(pair: tuple[Path, Path]) -> None:
    from safetensors.torch import load_file

    single, _ = pair
    cfg = ModelConfig.from_dir(single)
    w = load_weights(single, cfg, torch.bfloat16)
    raw = load_file(str(single / "model.safetensors"))
    p = "model.layers.0."
    q, k, v = (raw[f"{p}self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(w.layers[0].qkv, torch.cat([q, k, v]).to(torch.bfloat16))
    gate, up = raw[f"{p}mlp.gate_proj.weight"], raw[f"{p}mlp.up_proj.weight"]
    assert torch.equal(w.layers[0].gate_up, torch.cat([gate, up]).to(torch.bfloat16))
    assert w.lm_head is w.embed  # tied embeddings share one tensor


def test_missing_tensor_is_named(pair: tuple[Path, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    single, _ = pair
    tensors = load_file(str(single / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = ModelConfig.from_dir(single)
    with pytest.raises(ModelDirError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_weights(tmp_path, cfg, torch.float32)


def test_missing_weights_and_missing_shard_are_named(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    cfg = ModelConfig.from_dir(pair[0])
    with pytest.raises(ModelDirError, match="no \\*.safetensors"):
        load_weights(tmp_path, cfg, torch.float32)
    index = json.loads((pair[1] / "model.safetensors.index.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelDirError, match="missing shards"):
        load_weights(tmp_path, cfg, torch.float32)


def test_wrong_shape_is_named(pair: tuple[Path, Path]) -> None:
    cfg = ModelConfig.from_dir(pair[0])
    wrong = ModelConfig.from_hf_dict(
        json.loads((pair[0] / "config.json").read_text()) | {"intermediate_size": 96}
    )
    assert wrong != cfg
    with pytest.raises(ModelDirError, match="shape"):
        load_weights(pair[0], wrong, torch.float32)


def test_stored_dtype_is_the_embedding_tables(pair: tuple[Path, Path], tmp_path: Path) -> None:
    assert stored_dtype(pair[0]) == "float32"
    assert stored_dtype(pair[1]) == "float32"  # sharded: found in whichever shard holds it
    half = convert_checkpoint(pair[0], tmp_path / "half", torch.float16, None)
    assert stored_dtype(half) == "float16"


def test_float8_weights_without_a_quantization_config_are_refused(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    fp8 = convert_checkpoint(pair[0], tmp_path / "fp8", torch.float8_e4m3fn, None)
    cfg = ModelConfig.from_dir(fp8)  # the config says nothing: the stored tensors tell
    with pytest.raises(
        ModelDirError, match="stored as torch.float8_e4m3fn: a quantized checkpoint"
    ):
        load_weights(fp8, cfg, torch.bfloat16)
