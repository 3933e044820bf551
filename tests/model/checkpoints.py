"""Tiny Hugging Face checkpoints written by `transformers` itself, for equivalence tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

_TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "def main(argv):\n    return 0\n\nclass Page:\n    pass\n"
    "Sphinx of black quartz, judge my vow; naïve café — 東京 — emoji 🙂 done.\n"
)

# Common tiny dims: hidden 64, 2 layers, GQA 4:2.
_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,  # larger than default, so logits spread and errors show
}

ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama3_rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "rope_theta": 500000.0,
        },
    ),
    "llama_linear_rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "mistral": ("mistral", {"sliding_window": 24}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    # an odd vocabulary: a vocab-parallel LM head's last shard is one row short
    "qwen2_odd_vocab": ("qwen2", {"vocab_size": 321, "tie_word_embeddings": False}),
}


def write_tokenizer(path: Path) -> None:
    """A ~300-token byte-level BPE with BOS/EOS, so the checkpoint is a complete model dir."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TEXT] * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def write_checkpoint(path: Path, name: str, sharded: bool = False, seed: int = 0) -> Path:
    """Random-weight checkpoint of architecture ``name`` (a key of :data:`ARCHS`) at ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = ARCHS[name]
    config = AutoConfig.for_model(model_type, **(_BASE | overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), max_shard_size="60KB" if sharded else "1GB")
    write_tokenizer(path)
    return path


def convert_checkpoint(
    src: Path, dst: Path, dtype: torch.dtype, declared: str | None, **config: Any
) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with its tensors stored as ``dtype``, config.json
    declaring ``declared`` (None: no dtype at all) and the ``config`` entries added."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(dtype) for k, v in tensors.items()}, str(dst / "model.safetensors"))
    hf = json.loads((src / "config.json").read_text())
    hf = {k: v for k, v in hf.items() if k not in ("dtype", "torch_dtype")} | config
    if declared is not None:
        hf["torch_dtype"] = declared
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


def load_reference(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The transformers model for ``path``, eval mode, eager attention (the plain reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation="eager"
    )
    return model.eval()
