"""PageAllocator under any sequence of allocate / incref / free / cache_page, against a model.

The model keeps each page's reference count and key and the release order of unreferenced keyed
pages; after every operation the allocator agrees with it: no page handed out while referenced
or keyed-and-reusable, evictions least recently released first, free + cached + used == total.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.kernels.kv_cache import PageAllocator

N = 8


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(N)
        self.refs = [0] * N
        self.keys: dict[int, bytes] = {}
        self.released: list[int] = []  # unreferenced keyed pages, least recently released first
        self.n = 0

    @rule(n=st.integers(1, 3))
    def allocate(self, n: int) -> None:
        available = N - sum(1 for r in self.refs if r)
        if n > available:
            return
        pages = self.alloc.allocate(n)
        num_free = sum(1 for p in range(N) if self.refs[p] == 0 and p not in self.keys)
        evicted = self.released[: max(0, n - num_free)]
        for p in pages:
            assert self.refs[p] == 0, f"page {p} handed out while referenced"
            assert p not in self.keys or p in evicted, f"cached page {p} handed out too early"
        assert set(evicted) <= set(pages)
        for p in evicted:
            del self.keys[p]
            self.released.remove(p)
        for p in pages:
            self.refs[p] = 1

    @rule(data=st.data())
    @precondition(lambda self: any(self.refs))
    def free(self, data: st.DataObject) -> None:
        p = data.draw(st.sampled_from([p for p in range(N) if self.refs[p]]))
        self.alloc.free([p])
        self.refs[p] -= 1
        if self.refs[p] == 0 and p in self.keys:
            self.released.append(p)

    @rule(data=st.data())
    @precondition(lambda self: any(self.refs) or self.released)
    def incref(self, data: st.DataObject) -> None:
        live = [p for p in range(N) if self.refs[p]] + self.released
        p = data.draw(st.sampled_from(live))
        self.alloc.incref([p])
        if self.refs[p] == 0:
            self.released.remove(p)
        self.refs[p] += 1

    @rule(data=st.data())
    @precondition(lambda self: any(self.refs))
    def cache_page(self, data: st.DataObject) -> None:
        p = data.draw(st.sampled_from([p for p in range(N) if self.refs[p]]))
        key = f"k{self.n}".encode()
        self.n += 1
        assert self.alloc.cache_page(p, key) == (p not in self.keys)
        self.keys.setdefault(p, key)

    @invariant()
    def agrees_with_the_model(self) -> None:
        a = self.alloc
        a.check_integrity()
        assert [a.refcount(p) for p in range(N)] == self.refs
        assert all(a.cached_page(k) == p for p, k in self.keys.items())
        assert a.num_cached == len(self.released)
        assert a.num_used == sum(1 for r in self.refs if r)
        assert a.num_free + a.num_cached + a.num_used == N


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
