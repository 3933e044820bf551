"""ModelConfig from GGUF metadata."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve.model.checkpoint import load_model_config
from pdserve.model.config import ModelConfig, ModelDirError
from pdserve.model.gguf.config import gguf_model_config
from pdserve.model.gguf.file import open_gguf


def test_demo_gguf_config_equals_the_hf_checkpoint_s(demo_dir: Path, demo_f32_gguf: Path) -> None:
    hf = ModelConfig.from_dir(demo_dir)
    ours = load_model_config(demo_f32_gguf)
    # Stop ids: the HF config lists <|im_end|> and </s>; the GGUF file holds them as eos / eot.
    assert dataclasses.replace(ours, checkpoint_dtype="bfloat16") == hf
    assert ours.checkpoint_dtype == "float32"


def test_smollm2_config_is_read_from_its_metadata(smollm_gguf: Path) -> None:
    cfg = load_model_config(smollm_gguf)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert cfg.eos_token_ids == {2} and cfg.bos_token_id == 1
    assert cfg.checkpoint_dtype is None  # block-quantized: the runner picks the dtype


def test_an_unsupported_architecture_is_refused_with_the_supported_ones_named(
    demo_f32_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = open_gguf(demo_f32_gguf)
    monkeypatch.setattr(f, "architecture", "gemma3")
    with pytest.raises(ModelDirError, match="unsupported GGUF architecture 'gemma3'.*llama"):
        gguf_model_config(f)
