"""Rotary position embeddings (Su et al., 2021) with "linear" and "llama3" frequency scaling.

Uses the half-split ("rotate_half") convention of Hugging Face checkpoints: dimension ``i`` is
paired with ``i + head_dim/2``. Tables are built once for every position up to the model length.
"""

from __future__ import annotations

import math

import torch

from pdserve.model.config import RopeScaling


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """Per-pair rotation frequencies, ``(head_dim/2,)`` float32, after any scaling."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling {scaling.rope_type!r}")


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
    # (Llama 3.1 report, section 3.1 / the reference implementation).
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(
    max_positions: int,
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, signed_sin)``, each ``(max_positions, head_dim)`` in ``dtype``, built in float32.

    ``signed_sin`` carries rotate_half's minus sign on its first half, so that applying rope is
    ``x * cos + roll(x, head_dim/2) * signed_sin`` (see :func:`apply_rope`).
    """
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)
    signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
    return cos.to(dtype=dtype, device=device), signed_sin.to(dtype=dtype, device=device)


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate ``x`` ``(T, heads, head_dim)`` by per-token tables ``(T, head_dim)``.

    Equals the reference ``x * cos + rotate_half(x) * sin`` with
    ``rotate_half(x) = cat(-x2, x1)``: rolling by half a head gives ``cat(x2, x1)`` and the
    sign lives in the table, so this is three kernels instead of six. ``out`` may be ``x``
    itself (both products are taken before it is written): the result then lands in place,
    inside a larger fused projection output, with no extra copy.
    """
    rolled = x.roll(x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos.unsqueeze(1), rolled, signed_sin.unsqueeze(1), out=out)
