"""ModelConfig: the architecture facts the decoder needs, read from a Hugging Face model directory.

Reads ``config.json`` (plus ``generation_config.json`` and ``tokenizer_config.json`` for eos ids).
Both the transformers 4.x spelling (``rope_theta`` + ``rope_scaling``) and the 5.x spelling
(``rope_parameters``) are accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelDirError(ValueError):
    """A model directory is missing a file or holds something pdserve cannot serve."""


@dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling ("linear" or "llama3"); absent means plain rope."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one checkpoint, independent of how it is run (dtype, device, paging)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    checkpoint_dtype: str | None = None
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    bos_token_id: int | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` (and eos ids from the generation/tokenizer configs) in ``path``."""
        root = Path(path)
        if not root.is_dir():
            raise ModelDirError(f"model directory {str(root)!r} does not exist")
        hf = _read_json(root / "config.json", required=True)
        gen = _read_json(root / "generation_config.json", required=False)
        legacy = _read_json(root / "quantize_config.json", required=False)
        if legacy is not None and not hf.get("quantization_config"):
            # AutoGPTQ's own file, from before the settings moved into config.json.
            hf = hf | {"quantization_config": {"quant_method": "gptq"} | legacy}
        return cls.from_hf_dict(hf, gen)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], gen: dict[str, Any] | None = None) -> ModelConfig:
        """Build from a parsed ``config.json`` dict; ``gen`` is ``generation_config.json``."""
        arch = _architecture(hf)
        _refuse_quantized(hf)
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        theta, scaling = _rope(hf)
        eos = _id_set(hf.get("eos_token_id")) | _id_set((gen or {}).get("eos_token_id"))
        bos = (gen or {}).get("bos_token_id", hf.get("bos_token_id"))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            intermediate_size=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(arch, hf),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(arch, hf),
            checkpoint_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            eos_token_ids=frozenset(eos),
            bos_token_id=int(bos) if isinstance(bos, int) else None,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelDirError(f"{path.name} missing in model directory {str(path.parent)!r}")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{path} is not valid JSON: {e}") from e


def _architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
    by_type |= {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    arch = archs[0] if archs else by_type.get(hf.get("model_type", ""), "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelDirError(
            f"unsupported architecture {arch or hf.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelDirError(f"unsupported hidden_act {hf['hidden_act']!r} (only silu)")
    return arch


def _refuse_quantized(hf: dict[str, Any]) -> None:
    # Loading a quantized checkpoint's packed weights as plain ones (without their scales)
    # would produce garbage: refuse, naming the method.
    quant = hf.get("quantization_config")
    if not quant:
        return
    quant = quant if isinstance(quant, dict) else {}
    method = quant.get("quant_method")
    if method is None and (quant.get("load_in_4bit") or quant.get("load_in_8bit")):
        method = "bitsandbytes"
    raise ModelDirError(
        f"the checkpoint is quantized (quantization_config.quant_method {method or 'unknown'!r}); "
        "pdserve serves only unquantized float32, bfloat16 and float16 checkpoints"
    )


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelDirError(
            f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _attention_bias(arch: str, hf: dict[str, Any]) -> bool:
    # Qwen2 always has q/k/v biases; its config does not say so.
    return arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False))


def _sliding_window(arch: str, hf: dict[str, Any]) -> int | None:
    window = hf.get("sliding_window")
    if arch == "MistralForCausalLM":
        return int(window) if window else None
    if hf.get("use_sliding_window"):
        # Qwen applies the window only to some layers; not worth a special path here.
        raise ModelDirError(f"{arch} with use_sliding_window=true is not supported")
    return None


def _id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}
