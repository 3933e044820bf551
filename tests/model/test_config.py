"""ModelConfig parsing of config.json variants, and clear errors for bad model directories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.model.config import ModelConfig, ModelDirError

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
}


def _write(tmp_path: Path, config: dict[str, Any], gen: dict[str, Any] | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if gen is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    return tmp_path


def test_defaults_fill_kv_heads_head_dim_and_plain_rope(tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(_write(tmp_path, BASE))
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_scaling, cfg.rope_theta) == (4, 16, None, 1e4)
    assert not (cfg.attention_bias or cfg.qk_norm or cfg.tie_word_embeddings)


def test_transformers4_rope_scaling_and_transformers5_rope_parameters_agree(tmp_path: Path) -> None:
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling["original_max_position_embeddings"] = 8192
    v4 = ModelConfig.from_hf_dict(
        BASE | {"rope_theta": 5e5, "rope_scaling": scaling | {"rope_type": "llama3"}}
    )
    v5 = ModelConfig.from_hf_dict(
        BASE | {"rope_parameters": scaling | {"rope_type": "llama3", "rope_theta": 5e5}}
    )
    assert v4 == v5 and v4.rope_scaling is not None and v4.rope_scaling.factor == 8.0


def test_eos_ids_merge_config_and_generation_config(tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(
        _write(tmp_path, BASE | {"eos_token_id": 2}, {"eos_token_id": [2, 7]})
    )
    assert cfg.eos_token_ids == frozenset({2, 7})


def test_architecture_specifics(tmp_path: Path) -> None:
    qwen2 = ModelConfig.from_hf_dict(BASE | {"architectures": ["Qwen2ForCausalLM"]})
    qwen3 = ModelConfig.from_hf_dict(BASE | {"architectures": ["Qwen3ForCausalLM"]})
    mistral = ModelConfig.from_hf_dict(
        BASE | {"architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    )
    assert qwen2.attention_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and not qwen3.attention_bias
    assert mistral.sliding_window == 4096


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_configs_are_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelDirError, match=message):
        ModelConfig.from_hf_dict(BASE | change)


def test_missing_directory_and_config_are_named(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="does not exist"):
        ModelConfig.from_dir(tmp_path / "nope")
    with pytest.raises(ModelDirError, match="config.json missing"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("quantization_config", "method"),
    [
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "'gptq'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "'awq'"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "compressed-tensors"),
        ({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "'bitsandbytes'"),
    ],
)
def test_a_quantized_checkpoint_is_refused_naming_its_method(
    tmp_path: Path, quantization_config: dict[str, Any], method: str
) -> None:
    with pytest.raises(ModelDirError, match=f"quantized .*{method}"):
        ModelConfig.from_dir(_write(tmp_path, BASE | {"quantization_config": quantization_config}))


def test_autogptq_quantize_config_file_is_refused_too(tmp_path: Path) -> None:
    _write(tmp_path, BASE)
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    with pytest.raises(ModelDirError, match="quantized .*'gptq'"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_the_checkpoint_dtype_is_read_from_either_spelling(key: str) -> None:
    assert ModelConfig.from_hf_dict(BASE | {key: "float32"}).checkpoint_dtype == "float32"
