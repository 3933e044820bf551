"""Weight containers for the decoder: fused QKV and gate/up projections, one per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerWeights:
    """One decoder layer. ``qkv`` rows are ``[q; k; v]``, ``gate_up`` rows ``[gate; up]``."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # Qwen3: per-head RMSNorm on q and k
    k_norm: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@dataclass
class ModelWeights:
    embed: torch.Tensor  # (vocab, hidden)
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor  # (vocab, hidden); the same tensor as embed when tied

    @property
    def num_parameters(self) -> int:
        tensors = [self.embed, self.norm]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        return sum(t.numel() for t in tensors)
