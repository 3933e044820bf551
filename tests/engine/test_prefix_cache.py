"""PrefixCache keys: a request's cache_salt separates its pages from every other tenant's."""

from __future__ import annotations

from pdserve.engine.prefix_cache import PrefixCache
from pdserve.kernels.kv_cache import PageAllocator


def _cache() -> PrefixCache:
    return PrefixCache(PageAllocator(8), page_size=4)


def test_salted_keys_differ_from_every_other_salt_and_from_none() -> None:
    cache, ids = _cache(), list(range(12))
    plain = cache.extend_keys([], ids, 3)
    salted = cache.extend_keys([], ids, 3, "tenant-a")
    other = cache.extend_keys([], ids, 3, "tenant-b")
    assert len({*plain, *salted, *other}) == 9  # no page key shared by two tenants
    assert cache.extend_keys([], ids, 3, "tenant-a") == salted  # the same tenant finds its own


def test_extending_a_salted_chain_continues_it() -> None:
    cache, ids = _cache(), list(range(12))
    whole = cache.extend_keys([], ids, 3, "s")
    assert cache.extend_keys(whole[:1], ids, 3, "s") == whole
