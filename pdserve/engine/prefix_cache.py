"""Prefix caching: full KV pages found again by a chained hash of the tokens they hold.

Page ``i`` of a sequence is keyed by ``H(key of page i-1, salt, tokens of page i)``, so a key
names the whole prefix up to the end of its page, not just the page's own tokens (vLLM's block
hashes; SGLang's radix tree holds the same information). The salt covers what else changes the
KV of the same tokens (the model and KV dtype are fixed per engine, so it is empty by default).

Only full pages whose every token's K/V is written are registered, so a keyed page is never
written again: a request that reuses cached pages computes from the first token after them, in
pages of its own. The pages themselves, their reference counts and their LRU eviction live in
:class:`~pdserve.kernels.kv_cache.PageAllocator`; this class only hashes, looks up and registers.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from pdserve.kernels.kv_cache import PageAllocator
from pdserve.sequence import Sequence


@dataclass
class PrefixCacheStats:
    """Counters read by the metrics module (tokens of prompts looked up, and found cached)."""

    num_queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0


class PrefixCache:
    """Looks up and registers full pages of sequences in the allocator's key map."""

    def __init__(
        self, allocator: PageAllocator, page_size: int, *, enabled: bool = True, salt: bytes = b""
    ) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self._root = hashlib.blake2b(b"pdserve-prefix:" + salt, digest_size=16).digest()
        self.stats = PrefixCacheStats()

    def extend_keys(
        self, keys: list[bytes], token_ids: list[int], num_pages: int, salt: str | None = None
    ) -> list[bytes]:
        """Extend ``keys`` (the chained keys of ``token_ids``' first pages) to ``num_pages``.

        A request's ``cache_salt`` goes into its first page's key, so every key of its chain
        differs from an unsalted (or otherwise salted) request's: tenants share no pages.
        """
        ps = self.page_size
        parent = keys[-1] if keys else self._root
        if not keys and salt is not None:
            parent = hashlib.blake2b(parent + salt.encode(), digest_size=16).digest()
        for i in range(len(keys), num_pages):
            page = array("q", token_ids[i * ps : (i + 1) * ps]).tobytes()
            parent = hashlib.blake2b(parent + page, digest_size=16).digest()
            keys.append(parent)
        return keys

    def lookup(self, seq: Sequence, keys: list[bytes]) -> list[int]:
        """Cached pages of ``seq``'s longest cached prefix (no references taken).

        At least one token is always left to compute (its logits are the next token's), so a
        sequence cached to its very end reuses all but its last page.
        """
        if not self.enabled:
            return []
        num_full = seq.num_tokens // self.page_size
        self.extend_keys(keys, seq.token_ids, num_full, seq.sampling.cache_salt)
        pages: list[int] = []
        for key in keys[:num_full]:
            page = self.allocator.cached_page(key)
            if page is None:
                break
            pages.append(page)
        if pages and len(pages) * self.page_size >= seq.num_tokens:
            pages.pop()
        return pages

    def can_allocate_with(self, hit: list[int], num_new: int) -> bool:
        """Can ``num_new`` pages be allocated once ``hit`` (from :meth:`lookup`) is acquired?
        Reusing an unreferenced cached page takes it off the eviction list, so it no longer
        counts as allocatable."""
        reviving = sum(1 for p in hit if self.allocator.refcount(p) == 0)
        return self.allocator.can_allocate(num_new + reviving)

    def acquire(self, seq: Sequence, pages: list[int]) -> None:
        """Take a reference on ``pages`` (from :meth:`lookup`) as ``seq``'s leading pages."""
        self.allocator.incref(pages)
        seq.page_ids = list(pages)
        seq.num_cached_tokens = len(pages) * self.page_size
        self.stats.num_queries += 1
        self.stats.query_tokens += seq.num_tokens
        self.stats.hit_tokens += seq.num_cached_tokens

    def register(self, seq: Sequence, keys: list[bytes]) -> None:
        """Key every page of ``seq`` whose tokens' K/V are all written (a no-op when disabled).

        A page whose key another page already holds (two requests computed the same prefix at
        once) stays unkeyed and is freed normally on release.
        """
        if not self.enabled:
            return
        num_full = min(seq.num_cached_tokens // self.page_size, len(seq.page_ids))
        self.extend_keys(keys, seq.token_ids, num_full, seq.sampling.cache_salt)
        for page, key in zip(seq.page_ids[:num_full], keys[:num_full], strict=True):
            self.allocator.cache_page(page, key)
