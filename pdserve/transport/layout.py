"""The KV layout an engine registers with: its model identity and the shape of one page.

A prefill refuses a decode whose layout differs in any field (HTTP 400 ``layout_mismatch``
naming the fields), so KV is never written into pages that would read it back differently.
A tensor-parallel engine registers its one engine pool, every rank's heads in head-major pages
(kernels/kv_cache.py): the same layout as at TP1, so engines of different TP sizes pair and a
room's pages move as they do between TP1 engines.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import orjson

from pdserve.kernels.kv_cache import KVPagePool
from pdserve.transport.messages import KVLayoutMsg

# ModelConfig fields that say how the checkpoint is stored, not what it computes.
_NOT_IDENTITY = frozenset({"checkpoint_dtype"})


def model_fingerprint(model_config: Any) -> str:
    """A short stable hash of a model's architecture config (a dataclass, e.g. ``ModelConfig``).

    Two workers serving the same checkpoint get the same value; a different architecture,
    size, vocabulary or rope setting changes it. Weights are fingerprinted apart
    (``pdserve.model.fingerprint``), the served model name is the third part of the identity.
    """
    fields = {k: v for k, v in dataclasses.asdict(model_config).items() if k not in _NOT_IDENTITY}
    raw = orjson.dumps(fields, option=orjson.OPT_SORT_KEYS, default=_jsonable)
    return hashlib.sha256(raw).hexdigest()[:16]


def _jsonable(value: Any) -> Any:
    if isinstance(value, frozenset | set):
        return sorted(value)
    raise TypeError(f"cannot fingerprint {type(value).__name__}")


def layout_of(
    pool: KVPagePool, model: str = "", fingerprint: str = "", weights: str = ""
) -> KVLayoutMsg:
    """The layout of a local page pool, for registration and the check of a peer's;
    ``weights`` is ``pdserve.model.fingerprint.weights_fingerprint`` of the checkpoint."""
    c = pool.config
    return KVLayoutMsg(
        model=model,
        fingerprint=fingerprint,
        weights=weights,
        dtype=str(c.dtype).removeprefix("torch."),
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        page_size=c.page_size,
        page_bytes=pool.page_bytes,
    )


def layout_fingerprint(layout: KVLayoutMsg) -> str:
    """A short hash of a layout's page shape and model architecture (not its served name, nor
    its weights: workers publish those apart, so a router's refusal names what differs).

    Workers publish it to routers (``/server_info``, registration), which refuse to pair a
    prefill and a decode whose values differ before any bootstrap is tried.
    """
    fields = {k: v for k, v in dataclasses.asdict(layout).items() if k not in ("model", "weights")}
    return hashlib.sha256(orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
