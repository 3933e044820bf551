"""Which prefill and decode workers may be paired: those serving the same model (name and
weights), with the same KV dtype and page layout. The bootstrap refuses a mismatched pair too
(``layout_mismatch``), but only once a request is already on it; the router keeps such workers
out of its pairs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

PAIRED_ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class Identity:
    """What must agree between a prefill and a decode. Empty ``dtype``/``kv_layout``/``weights``
    (a worker that does not publish them) match anything."""

    model: str
    dtype: str
    kv_layout: str
    weights: str = ""  # model.fingerprint.weights_fingerprint: one architecture, other weights

    def mismatch(self, other: Identity) -> str | None:
        """A sentence naming every field that differs from ``other``, or None."""
        diffs = [f"model {self.model!r} != {other.model!r}"] if self.model != other.model else []
        for name in ("dtype", "kv_layout", "weights"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine and theirs and mine != theirs:
                diffs.append(f"{name} {mine!r} != {theirs!r}")
        return "; ".join(diffs) or None


class HasIdentity(Protocol):
    role: str
    url: str

    @property
    def identity(self) -> Identity | None: ...

    @property
    def is_healthy(self) -> bool: ...


def incompatible(workers: Sequence[HasIdentity]) -> dict[str, str]:
    """url -> reason for each prefill/decode worker that cannot pair with the fleet.

    The fleet's identity is the one most healthy prefill and decode workers share (ties: the
    one registered first), so one odd worker, whatever its role and arrival, is the one left
    out. Workers whose identity is not known yet are not judged.
    """
    paired = [w for w in workers if w.role in PAIRED_ROLES and w.identity is not None]
    healthy = [w.identity for w in paired if w.is_healthy]
    if not healthy:
        return {}
    counts = Counter(healthy)
    best = max(counts.values())
    reference = next(i for i in healthy if counts[i] == best)
    out: dict[str, str] = {}
    for w in paired:
        assert w.identity is not None
        reason = w.identity.mismatch(reference)
        if reason is not None:
            out[w.url] = f"incompatible with the fleet's {reference.model!r} workers: {reason}"
    return out
