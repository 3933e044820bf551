"""Load Hugging Face safetensors checkpoints (single file or sharded) into :class:`ModelWeights`.

Tensors are read one layer at a time, onto the serving device, and fused (QKV, gate/up) as they
are converted to the serving dtype, so peak memory stays near the size of the converted model.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pdserve.model.config import ModelConfig, ModelDirError
from pdserve.model.weights import LayerWeights, ModelWeights

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# Weight dtypes the decoder converts from; anything else (float8, int8/int4 packs) is quantized.
LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
EMBED = "model.embed_tokens.weight"


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from the shard index when there is one."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelDirError(f"{INDEX_FILE} in {model_dir} lists missing shards: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelDirError(
            f"no *.safetensors weights in {str(model_dir)!r} (pytorch .bin is not supported)"
        )
    return files


def stored_dtype(model_dir: str | Path) -> str | None:
    """The dtype the embedding table is stored in ("float32", "bfloat16", "float16"), for a
    checkpoint whose config.json does not say; None if unknown."""
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as handle:
            if EMBED in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                return _SAFETENSORS_DTYPES.get(handle.get_slice(EMBED).get_dtype())
    return None


class _TensorSource:
    """Name -> tensor lookup across all shard files, converting on read."""

    def __init__(self, stack: ExitStack, files: list[Path], dtype: torch.dtype, device: str):
        self._handles: dict[str, Any] = {}
        self._dtype = dtype
        self._device = device
        target = torch.device(device)
        if target.type == "cuda" and target.index is None:  # safetensors wants an index
            target = torch.device("cuda", torch.cuda.current_device())
        for path in files:
            # Read straight into the target device's memory (a CUDA worker never holds more
            # than the tensor being read on the host); dtype conversion then runs there too.
            handle = stack.enter_context(safe_open(str(path), framework="pt", device=str(target)))
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                self._handles[name] = handle
        self.files = files

    def has(self, name: str) -> bool:
        return name in self._handles

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self._handles:
            raise ModelDirError(
                f"tensor {name!r} not found in {[f.name for f in self.files]} "
                f"(in {str(self.files[0].parent)!r})"
            )
        tensor = self._handles[name].get_tensor(name)
        if tensor.dtype not in LOADABLE_DTYPES:
            raise ModelDirError(
                f"tensor {name!r} is stored as {tensor.dtype}: a quantized checkpoint, which "
                "pdserve cannot serve (only float32, bfloat16 and float16 weights)"
            )
        if shape is not None and tuple(tensor.shape) != shape:
            raise ModelDirError(f"tensor {name!r} has shape {tuple(tensor.shape)}, want {shape}")
        return tensor.to(dtype=self._dtype, device=self._device)

    def maybe(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.get(name, shape) if self.has(name) else None

    def cat(self, names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        return torch.cat([self.get(n, s) for n, s in zip(names, shapes, strict=True)], dim=0)


def _layer(src: _TensorSource, cfg: ModelConfig, i: int) -> LayerWeights:
    p = f"model.layers.{i}."
    hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv_rows = [cfg.q_size, cfg.kv_size, cfg.kv_size]
    attn = [f"{p}self_attn.{n}_proj" for n in "qkv"]
    mlp = [f"{p}mlp.gate_proj", f"{p}mlp.up_proj"]
    layer = LayerWeights(
        input_norm=src.get(f"{p}input_layernorm.weight", (hidden,)),
        qkv=src.cat([n + ".weight" for n in attn], [(r, hidden) for r in qkv_rows]),
        o_proj=src.get(f"{p}self_attn.o_proj.weight", (hidden, cfg.q_size)),
        post_norm=src.get(f"{p}post_attention_layernorm.weight", (hidden,)),
        gate_up=src.cat([n + ".weight" for n in mlp], [(inter, hidden)] * 2),
        down=src.get(f"{p}mlp.down_proj.weight", (hidden, inter)),
    )
    if cfg.attention_bias:
        layer.qkv_bias = src.cat([n + ".bias" for n in attn], [(r,) for r in qkv_rows])
        layer.o_bias = src.maybe(f"{p}self_attn.o_proj.bias", (hidden,))
    if cfg.qk_norm:
        layer.q_norm = src.get(f"{p}self_attn.q_norm.weight", (d,))
        layer.k_norm = src.get(f"{p}self_attn.k_norm.weight", (d,))
    if cfg.mlp_bias:
        layer.gate_up_bias = src.cat([n + ".bias" for n in mlp], [(inter,)] * 2)
        layer.down_bias = src.get(f"{p}mlp.down_proj.bias", (hidden,))
    return layer


def load_weights(
    model_dir: str | Path, config: ModelConfig, dtype: torch.dtype, device: str = "cpu"
) -> ModelWeights:
    """Read every tensor the decoder needs, fused and converted to ``dtype`` on ``device``."""
    root = Path(model_dir)
    files = checkpoint_files(root)
    vocab_shape = (config.vocab_size, config.hidden_size)
    with ExitStack() as stack:
        src = _TensorSource(stack, files, dtype, device)
        embed = src.get(EMBED, vocab_shape)
        if config.tie_word_embeddings or not src.has("lm_head.weight"):
            if not config.tie_word_embeddings:
                logger.warning("%s: no lm_head.weight, tying it to the embeddings", root)
            lm_head = embed
        else:
            lm_head = src.get("lm_head.weight", vocab_shape)
        layers = [_layer(src, config, i) for i in range(config.num_layers)]
        norm = src.get("model.norm.weight", (config.hidden_size,))
    weights = ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
    logger.info(
        "loaded %s from %d file(s): %.1fM parameters as %s on %s",
        config.architecture, len(files), weights.num_parameters / 1e6, dtype, device,
    )  # fmt: skip
    return weights
