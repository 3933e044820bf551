"""ModelConfig from a GGUF file's metadata (``general.architecture`` and its ``<arch>.*`` keys).

The tensor table fills what the metadata leaves implicit: the vocabulary size (the embedding's
rows), tied embeddings (no ``output.weight``) and QKV biases (``attn_q.bias``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdserve.model.config import ModelConfig, ModelDirError, RopeScaling
from pdserve.model.gguf.file import GGUFFile

# GGUF architecture -> the Hugging Face class pdserve's decoder implements. Mistral-style models
# are written as "llama" by llama.cpp's converter.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# The GGML types pdserve runs: dense ones, and the block types the quantized CPU matmul reads
# (pdserve.kernels.quant_gemm.SUPPORTED_TYPES, kept equal by a test; named here so the
# launcher's check needs no torch). Any other type is refused at load, by name.
SUPPORTED_GGML_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
# The dtype a file's dense matrices are stored in, by GGML type name.
_DENSE_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def gguf_model_config(f: GGUFFile) -> ModelConfig:
    """The decoder's architecture facts from ``f`` (ModelDirError for anything unsupported)."""
    arch = ARCHITECTURES.get(f.architecture)
    if arch is None:
        raise ModelDirError(
            f"{f.path.name}: unsupported GGUF architecture {f.architecture!r}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    if "token_embd.weight" not in f.tensors:
        raise ModelDirError(f"{f.path.name}: no token_embd.weight tensor")
    check_tensor_types(f)
    hidden = int(f.arch_value("embedding_length"))
    num_heads = int(f.arch_value("attention.head_count"))
    head_dim = int(f.arch_value("attention.key_length", 0) or hidden // num_heads)
    theta, scaling = _rope(f, head_dim)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(f.tensors["token_embd.weight"].data.shape[0]),
        hidden_size=hidden,
        num_layers=int(f.arch_value("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(f.arch_value("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        intermediate_size=int(f.arch_value("feed_forward_length")),
        rms_norm_eps=_decimal(f.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(f.arch_value("context_length", 2048)),
        tie_word_embeddings="output.weight" not in f.tensors,
        attention_bias="blk.0.attn_q.bias" in f.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in f.tensors,
        checkpoint_dtype=stored_dtype(f),
        eos_token_ids=frozenset(stop_token_ids(f)),
        bos_token_id=_int_or_none(f.value("tokenizer.ggml.bos_token_id", None)),
    )


def check_tensor_types(f: GGUFFile) -> None:
    """Refuses a file holding a tensor type pdserve cannot run, naming the tensor and the type
    (from the tensor table alone: before any weight is read)."""
    for name, t in f.tensors.items():
        kind = t.tensor_type.name
        if kind not in SUPPORTED_GGML_TYPES:
            raise ModelDirError(
                f"{f.path.name}: tensor {name!r} is stored as {kind}, a GGML type pdserve "
                f"cannot run; supported: {', '.join(SUPPORTED_GGML_TYPES)} (re-quantize the "
                "file to one of them, e.g. llama-quantize --allow-requantize IN OUT Q4_K_M)"
            )


def stored_dtype(f: GGUFFile) -> str | None:
    """The dtype the file's matrices are stored in; None where some are block-quantized
    (:func:`pdserve.model.checkpoint.declared_dtype` picks the activations' dtype then)."""
    types = {t.tensor_type.name for t in f.tensors.values() if len(t.shape) == 2}
    if types - set(_DENSE_DTYPES):
        return None
    # Mixed files (e.g. F32 embeddings beside F16 projections): the narrower type is the model's.
    for name in ("BF16", "F16", "F32"):
        if name in types:
            return _DENSE_DTYPES[name]
    return None


def stop_token_ids(f: GGUFFile) -> set[int]:
    """End-of-generation ids: eos, end-of-turn and end-of-message, as the file names them."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = {_int_or_none(f.value(f"tokenizer.ggml.{k}", None)) for k in keys}
    return {i for i in ids if i is not None}


def _rope(f: GGUFFile, head_dim: int) -> tuple[float, RopeScaling | None]:
    theta = _decimal(f.arch_value("rope.freq_base", 10000.0))
    rope_dims = int(f.arch_value("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelDirError(f"{f.path.name}: partial rope ({rope_dims} of {head_dim}) unsupported")
    if "rope_freqs.weight" in f.tensors:
        # Llama 3.1+ files carry per-frequency factors instead of the scaling parameters.
        raise ModelDirError(
            f"{f.path.name}: rope frequency factors (rope_freqs.weight, Llama 3.1-style scaling) "
            "are not supported in GGUF files; serve the Hugging Face checkpoint instead"
        )
    kind = f.arch_value("rope.scaling.type", "none")
    if kind == "none":
        return theta, None
    if kind != "linear":
        raise ModelDirError(f"{f.path.name}: unsupported rope scaling {kind!r} (none, linear)")
    factor = float(f.arch_value("rope.scaling.factor", 1.0))
    return theta, RopeScaling(rope_type="linear", factor=factor)


def _decimal(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06),
    so a GGUF checkpoint's config equals its Hugging Face original's."""
    return float(str(np.float32(value)))


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int) else None
