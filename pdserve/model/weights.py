"""Weight containers for the decoder: fused QKV and gate/up projections, one per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import torch

from pdserve.model.quantized import QuantizedTensor

# A projection's weight: dense, GGUF block-quantized, or (a fused projection whose parts are
# stored in different types) its quantized parts in row order.
Projection: TypeAlias = "torch.Tensor | QuantizedTensor | list[QuantizedTensor]"


def projection_parts(weight: Projection) -> list[torch.Tensor | QuantizedTensor]:
    return list(weight) if isinstance(weight, list) else [weight]


def num_elements(weight: Projection) -> int:
    return sum(
        p.shape[0] * p.shape[1] if isinstance(p, QuantizedTensor) else p.numel()
        for p in projection_parts(weight)
    )


def num_bytes(weight: Projection) -> int:
    """Bytes held: packed size for quantized parts."""
    return sum(
        p.num_bytes if isinstance(p, QuantizedTensor) else p.numel() * p.element_size()
        for p in projection_parts(weight)
    )


@dataclass
class LayerWeights:
    """One decoder layer. ``qkv`` rows are ``[q; k; v]``, ``gate_up`` rows ``[gate; up]``."""

    input_norm: torch.Tensor
    qkv: Projection
    o_proj: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # Qwen3: per-head RMSNorm on q and k
    k_norm: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@dataclass
class ModelWeights:
    # (vocab, hidden): dense, or (GGUF on CPUs) block-quantized, its rows dequantized as looked up
    embed: torch.Tensor | QuantizedTensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: Projection  # (vocab, hidden); the same object as embed when tied

    def _weights(self) -> list[Projection]:
        weights: list[Projection] = [self.embed, self.norm]
        if self.lm_head is not self.embed:
            weights.append(self.lm_head)
        for layer in self.layers:
            weights += [t for t in vars(layer).values() if t is not None]
        return weights

    @property
    def num_parameters(self) -> int:
        return sum(num_elements(w) for w in self._weights())

    @property
    def num_bytes(self) -> int:
        """Memory the weights hold, quantized ones at their packed size."""
        return sum(num_bytes(w) for w in self._weights())
