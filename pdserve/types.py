"""Plain value types shared by layers that must not import each other.

The runner and its kernels produce them, the engine and the HTTP layer pass them on; living here,
below all of them, they keep every import pointing down (``kernels`` and the runner never import
the engine).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One sampled (or prompt) token's logprob, with the ``top`` alternatives when asked for."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
