"""ModelWeights from a GGUF file's tensors.

Dense tensors (F32, F16, BF16) are converted to the serving dtype. Block-quantized projections
stay packed as :class:`~pdserve.model.quantized.QuantizedTensor` on CPUs (the quantized matmul
reads them at their packed size); on CUDA, where no quantized kernel exists yet, they are
dequantized to the serving dtype at load. The embedding table is always dense (a lookup reads a
few rows); a tied LM head keeps the file's quantized table.

llama.cpp's converter permutes the Q and K rows of Llama-architecture files (to pair rotary
halves as interleaved neighbours); :func:`unpermute_rows` undoes that, moving whole rows.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pdserve.model.config import ModelConfig, ModelDirError
from pdserve.model.gguf.file import GGUFFile
from pdserve.model.quantized import QuantizedTensor
from pdserve.model.weights import LayerWeights, ModelWeights, Projection

logger = logging.getLogger(__name__)

_DENSE = ("F32", "F16", "BF16")
Matrix = torch.Tensor | QuantizedTensor


def unpermute_rows(num_heads: int, head_dim: int) -> np.ndarray:
    """Row index taking llama.cpp's interleaved rotary order back to Hugging Face's halves:
    HF row ``h*D + j*D/2 + i`` is GGUF row ``h*D + 2*i + j``."""
    half = head_dim // 2
    heads = np.arange(num_heads)[:, None, None] * head_dim
    index = heads + np.arange(2)[None, :, None] + 2 * np.arange(half)[None, None, :]
    return index.reshape(-1)  # (num_heads * head_dim,) in (h, j, i) order


class _GGUFTensors:
    """Name -> tensor, dense ones converted to ``dtype`` on ``device``; quantized ones packed
    (or, with ``dequantize``, dense in ``dtype``)."""

    def __init__(self, f: GGUFFile, dtype: torch.dtype, device: str, dequantize: bool) -> None:
        self.f, self.dtype, self.device, self.dequantize = f, dtype, device, dequantize
        self.num_dequantized = 0

    def has(self, name: str) -> bool:
        return name in self.f.tensors

    def _reader_tensor(self, name: str, shape: tuple[int, ...]):  # noqa: ANN202 - gguf's type
        t = self.f.tensors.get(name)
        if t is None:
            raise ModelDirError(f"{self.f.path.name}: tensor {name!r} missing")
        if tuple(int(d) for d in reversed(t.shape)) != shape:
            raise ModelDirError(
                f"{self.f.path.name}: tensor {name!r} has shape {tuple(reversed(t.shape))}, "
                f"want {shape}"
            )
        return t

    def dense(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self._reader_tensor(name, shape)
        kind = t.tensor_type.name
        if kind == "BF16":
            raw = torch.from_numpy(np.array(t.data).view(np.int16))  # a copy: the file is read-only
            tensor = raw.view(torch.bfloat16).reshape(shape)
        elif kind in _DENSE:
            tensor = torch.from_numpy(np.array(t.data)).reshape(shape)
        else:
            tensor = self._packed(t, shape).dequantize(torch.float32)
        return tensor.to(dtype=self.dtype, device=self.device)

    def matrix(self, name: str, shape: tuple[int, int]) -> torch.Tensor | QuantizedTensor:
        t = self._reader_tensor(name, shape)
        if t.tensor_type.name in _DENSE:
            return self.dense(name, shape)
        packed = self._packed(t, shape)
        if not self.dequantize:
            return packed
        self.num_dequantized += 1
        return packed.dequantize(torch.float32).to(dtype=self.dtype, device=self.device)

    def _packed(self, t, shape: tuple[int, ...]) -> QuantizedTensor:  # noqa: ANN001
        # No copy: a read-only view of the mapped file. The kernel packs its panels from it,
        # an embedding lookup reads its rows; the file's bytes are in memory once.
        data = t.data.reshape(shape[0], -1)
        return QuantizedTensor(t.tensor_type.name, (shape[0], shape[1]), data)

    def fused(self, parts: list[Matrix]) -> Projection:
        """Row-stacked parts (QKV, gate/up): one dense matrix where all are dense, else the list
        of quantized parts, uncopied (the kernel runs them in one call, or they are dequantized
        and stacked); a dense part beside quantized ones becomes an F32 "quantized" part (exact
        for F16/BF16/F32)."""
        if all(isinstance(p, torch.Tensor) for p in parts):
            return torch.cat(parts, dim=0)  # type: ignore[arg-type]
        return [p if isinstance(p, QuantizedTensor) else _as_f32_part(p) for p in parts]


def _layer(src: _GGUFTensors, cfg: ModelConfig, i: int, is_llama: bool) -> LayerWeights:
    p = f"blk.{i}."
    hidden, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    gate_up = ("gate", "up")
    q = src.matrix(f"{p}attn_q.weight", (cfg.q_size, hidden))
    k = src.matrix(f"{p}attn_k.weight", (cfg.kv_size, hidden))
    if is_llama:
        q = _take_rows(q, unpermute_rows(cfg.num_heads, d))
        k = _take_rows(k, unpermute_rows(cfg.num_kv_heads, d))
    v = src.matrix(f"{p}attn_v.weight", (cfg.kv_size, hidden))
    layer = LayerWeights(
        input_norm=src.dense(f"{p}attn_norm.weight", (hidden,)),
        qkv=src.fused([q, k, v]),
        o_proj=src.matrix(f"{p}attn_output.weight", (hidden, cfg.q_size)),
        post_norm=src.dense(f"{p}ffn_norm.weight", (hidden,)),
        gate_up=src.fused([src.matrix(f"{p}ffn_{n}.weight", (inter, hidden)) for n in gate_up]),
        down=src.matrix(f"{p}ffn_down.weight", (hidden, inter)),
    )
    if cfg.attention_bias:
        biases = [src.dense(f"{p}attn_{n}.bias", (r,)) for n, r in
                  (("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size))]  # fmt: skip
        if is_llama:
            biases[0] = biases[0][unpermute_rows(cfg.num_heads, d)]
            biases[1] = biases[1][unpermute_rows(cfg.num_kv_heads, d)]
        layer.qkv_bias = torch.cat(biases)
        if src.has(f"{p}attn_output.bias"):
            layer.o_bias = src.dense(f"{p}attn_output.bias", (hidden,))
    if cfg.qk_norm:
        layer.q_norm = src.dense(f"{p}attn_q_norm.weight", (d,))
        layer.k_norm = src.dense(f"{p}attn_k_norm.weight", (d,))
    return layer


def _as_f32_part(dense: torch.Tensor) -> QuantizedTensor:
    rows = np.ascontiguousarray(dense.float().cpu().numpy()).view(np.uint8)  # (N, 4K)
    return QuantizedTensor("F32", (dense.shape[0], dense.shape[1]), rows)


def _take_rows(w: Matrix, index: np.ndarray) -> Matrix:
    if isinstance(w, QuantizedTensor):
        return w.take_rows(index)
    return w[torch.from_numpy(index).to(w.device)].contiguous()


def load_gguf_weights(
    f: GGUFFile, config: ModelConfig, dtype: torch.dtype, device: str = "cpu"
) -> ModelWeights:
    """Every tensor the decoder needs from ``f``; quantized projections packed on CPUs."""
    on_cuda = torch.device(device).type == "cuda"
    src = _GGUFTensors(f, dtype, device, dequantize=on_cuda)
    vocab_shape = (config.vocab_size, config.hidden_size)
    # CPUs look a quantized table's rows up packed (no dense copy: the 1.5B's would be 933 MB
    # of float32); CUDA looks them up in a dense table on the device.
    embed: Matrix = (
        src.dense("token_embd.weight", vocab_shape)
        if on_cuda
        else src.matrix("token_embd.weight", vocab_shape)
    )
    if config.tie_word_embeddings:
        lm_head: Projection = embed  # the packed matmul where the table is quantized
    else:
        lm_head = src.matrix("output.weight", vocab_shape)
    is_llama = f.architecture == "llama"
    layers = [_layer(src, config, i, is_llama) for i in range(config.num_layers)]
    norm = src.dense("output_norm.weight", (config.hidden_size,))
    weights = ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
    if src.num_dequantized:
        logger.info(
            "%s: %d quantized matrices dequantized to %s at load (no quantized kernel on %s)",
            f.path.name, src.num_dequantized, dtype, device,
        )  # fmt: skip
    logger.info(
        "loaded %s from %s: %.1fM parameters, %.1f MiB of weights (%s) on %s",
        config.architecture, f.path.name, weights.num_parameters / 1e6,
        weights.num_bytes / 2**20, dtype, device,
    )  # fmt: skip
    return weights
