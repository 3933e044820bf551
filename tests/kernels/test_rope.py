"""Rotary embeddings: frequencies equal transformers' rope init functions; rotation is exact."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.rope import apply_rope, inverse_frequencies, rope_tables
from pdserve.model.config import RopeScaling

LLAMA3 = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=64)  # fmt: skip


@pytest.mark.parametrize("scaling", [None, RopeScaling("linear", factor=4.0), LLAMA3])
def test_inverse_frequencies_match_transformers(scaling: RopeScaling | None) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params: dict[str, object] = {"rope_type": "default", "rope_theta": 5e5}
    if scaling is not None:
        params = vars(scaling) | {"rope_theta": 5e5}
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=params)
    if scaling is None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        expected = LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    else:
        expected = ROPE_INIT_FUNCTIONS[scaling.rope_type](config, "cpu")[0]
    torch.testing.assert_close(inverse_frequencies(64, 5e5, scaling), expected)


def test_rotation_preserves_norm_and_relative_angle() -> None:
    cos, sin = rope_tables(32, 8, 10000.0, None, torch.float32)
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    qa, ka = apply_rope(q, cos[[5]], sin[[5]]), apply_rope(k, cos[[2]], sin[[2]])
    qb, kb = apply_rope(q, cos[[13]], sin[[13]]), apply_rope(k, cos[[10]], sin[[10]])
    torch.testing.assert_close(qa.norm(), q.norm())
    # Scores depend only on the distance between positions (5-2 == 13-10).
    torch.testing.assert_close((qa * ka).sum(), (qb * kb).sum())
    assert not torch.allclose((qa * ka).sum(), (q * k).sum())


def test_apply_rope_equals_the_rotate_half_formula() -> None:
    cos, signed_sin = rope_tables(16, 8, 10000.0, LLAMA3, torch.float32)
    x, pos = torch.randn(5, 3, 8), torch.tensor([0, 1, 7, 8, 15])
    sin = signed_sin[:, 4:].repeat(1, 2)  # the unsigned table
    rotate_half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    expected = x * cos[pos].unsqueeze(1) + rotate_half * sin[pos].unsqueeze(1)
    torch.testing.assert_close(apply_rope(x, cos[pos], signed_sin[pos]), expected)


def test_rope_written_in_place_into_a_fused_projection_equals_out_of_place() -> None:
    torch.manual_seed(0)
    cos, sin = rope_tables(32, 8, 10000.0, None, torch.float32)
    heads = torch.randn(5, 7, 8)  # q (4 heads) + k (1) + v (2), as the fused QKV output
    positions = torch.tensor([0, 3, 9, 17, 31])
    expected = apply_rope(heads[:, :5], cos[positions], sin[positions])
    untouched = heads[:, 5:].clone()
    qk = heads[:, :5]
    apply_rope(qk, cos[positions], sin[positions], out=qk)
    assert torch.equal(heads[:, :5], expected) and torch.equal(heads[:, 5:], untouched)
