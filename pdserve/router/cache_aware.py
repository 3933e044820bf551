"""Cache-aware routing: send a request where its prefix was sent before, unless load says no.

Like sgl-router's ``cache_aware`` policy, the router keeps, per worker, an approximate prefix
tree of the request texts it routed there: the text is cut into fixed-size character chunks and
chunk ``i`` is named by a hash chained over chunks ``0..i``, so a set of chunk names is a prefix
tree without the nodes. Each worker's set is an LRU bounded in entries (its cache evicts too).

Choice, for one request:

1. Load first: if the busiest candidate has more than ``balance_abs`` requests over the idlest
   *and* more than ``balance_rel`` times as many, the idlest wins (a hot prefix must not pile
   onto one worker). A worker's requests: the router's in-flight count to it, or the count the
   worker reports when larger (other routers' traffic); ties on it go to more free KV pages.
2. Otherwise the candidate holding the longest prefix of the text wins when that prefix is at
   least ``cache_threshold`` of the text (ties: the less loaded).
3. Otherwise the least loaded candidate (ties: the one whose tree holds least, the most room).

The chosen worker's tree then records the whole text.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.router.prompt_size import conversation, part_texts
from pdserve.router.workers import Worker


@dataclass(frozen=True)
class CacheAwareConfig:
    cache_threshold: float = 0.5  # matched fraction of the text that makes a worker "hold" it
    balance_abs: int = 16  # in-flight gap (and ...
    balance_rel: float = 1.5  # ... ratio) past which load decides alone
    chunk_chars: int = 64  # characters per tree edge
    max_chunks_per_worker: int = 1 << 16  # LRU bound of each worker's tree (64 Ki chunks)
    max_text_chars: int = 1 << 18  # longer texts are routed by their first 256 KiB characters


class PrefixTrees:
    """Per-worker LRU sets of chained chunk hashes (approximate prefix trees)."""

    def __init__(self, config: CacheAwareConfig) -> None:
        self.config = config
        self._trees: dict[str, OrderedDict[int, None]] = {}

    def chunk_keys(self, text: str) -> list[int]:
        c = self.config
        text = text[: c.max_text_chars]
        keys, parent = [], 0
        for start in range(0, len(text), c.chunk_chars):
            parent = hash((parent, text[start : start + c.chunk_chars]))
            keys.append(parent)
        return keys

    def matched(self, url: str, keys: list[int]) -> int:
        """How many leading chunks of ``keys`` the worker's tree holds."""
        tree = self._trees.get(url)
        if not tree:
            return 0
        n = 0
        for key in keys:
            if key not in tree:
                break
            n += 1
        return n

    def insert(self, url: str, keys: list[int]) -> None:
        tree = self._trees.setdefault(url, OrderedDict())
        for key in keys:
            tree[key] = None
            tree.move_to_end(key)
        while len(tree) > self.config.max_chunks_per_worker:
            tree.popitem(last=False)

    def size(self, url: str) -> int:
        return len(self._trees.get(url, ()))


class CacheAwarePolicy:
    """Prefix affinity balanced against the workers' loads (see module doc)."""

    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = config or CacheAwareConfig()
        self.trees = PrefixTrees(self.config)

    def choose(self, candidates: Sequence[Worker], key: str | None = None) -> Worker:
        keys = self.trees.chunk_keys(key) if key else []
        worker = self._pick(candidates, keys)
        if keys:
            self.trees.insert(worker.url, keys)
        return worker

    def _pick(self, candidates: Sequence[Worker], keys: list[int]) -> Worker:
        c = self.config
        # Requests per worker: the router's own in-flight count, or the worker's reported
        # count when larger (another router's traffic shows only there; Worker.load_score).
        loads = [w.load_score()[0] for w in candidates]
        low, high = min(loads), max(loads)
        least_loaded = min(candidates, key=lambda w: (w.load_score(), self.trees.size(w.url)))
        if not keys or (high - low > c.balance_abs and high > low * c.balance_rel):
            return least_loaded
        matches = [self.trees.matched(w.url, keys) for w in candidates]
        best = max(range(len(candidates)), key=lambda i: (matches[i], -loads[i]))
        if matches[best] / len(keys) >= c.cache_threshold:
            return candidates[best]
        return least_loaded


def routing_text(body: dict[str, Any]) -> str | None:
    """The text a request's prompt starts with, as the router sees it (no tokenizer): chat
    messages' roles and contents in order (a ``/v1/responses`` body's as the chat it stands
    for, so both share a key), or a completion's prompt (the first of a batch)."""
    messages = conversation(body)
    if messages is not None:
        parts = []
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"<{m.get('role')}>{_content_text(m.get('content'))}")
        return "".join(parts) or None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        prompt = prompt if isinstance(first, int) else first  # token ids, or a batch's first
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt) or None
    return prompt if isinstance(prompt, str) and prompt else None


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text, in order
        return "".join(part_texts(content))
    return ""
