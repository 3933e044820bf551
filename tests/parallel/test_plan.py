"""The prefill-to-decode KV transfer plan: exhaustive properties over the power-of-two sizes, the
design note's named pairs exactly, and input validation.

Both engines derive the plan on their own at ``/register``; a head left out is garbage attention on
decode, a head sent twice is a write race, and a wrong source sends another head's bytes. So the
exhaustive checks rebuild global head ids from ``kv_heads_of_rank`` rather than trusting the plan.
"""

from __future__ import annotations

import itertools

import pytest

from pdserve.parallel.plan import (
    PlanEntry,
    check_tp_kv_heads,
    kv_heads_of_rank,
    plan,
    ranks_holding_head,
    sources_of,
    writes_per_chunk,
)

SIZES = (1, 2, 4, 8)
# Any two powers of two divide one another, so every combination of SIZES is valid.
COMBOS = list(itertools.product(SIZES, SIZES, SIZES))
COMBO_IDS = [f"P{m}-D{n}-Hkv{h}" for m, n, h in COMBOS]


def _global(rank: int, tp: int, hkv: int, offset: int, count: int) -> list[int]:
    """Global head ids of ``count`` local heads from ``offset`` on ``rank``; fails off the range."""
    local = kv_heads_of_rank(rank, tp, hkv)
    assert offset >= 0 and offset + count <= len(local), (rank, offset, count, local)
    return list(local[offset : offset + count])


@pytest.mark.parametrize(("m", "n", "hkv"), COMBOS, ids=COMBO_IDS)
def test_every_decode_head_is_written_exactly_once(m: int, n: int, hkv: int) -> None:
    """A missing head is unwritten KV on decode; a doubled one is two writers racing a page."""
    written = [
        (e.dst_rank, head)
        for e in plan(m, n, hkv)
        for head in _global(e.dst_rank, n, hkv, e.dst_head_offset, e.num_heads)
    ]
    wanted = [(d, head) for d in range(n) for head in kv_heads_of_rank(d, n, hkv)]
    assert sorted(written) == sorted(wanted)


@pytest.mark.parametrize(("m", "n", "hkv"), COMBOS, ids=COMBO_IDS)
def test_every_source_holds_the_heads_it_writes(m: int, n: int, hkv: int) -> None:
    """Offsets are local; the same global heads on both ends make the bytes the right KV."""
    for e in plan(m, n, hkv):
        assert e.num_heads >= 1 and 0 <= e.src_rank < m and 0 <= e.dst_rank < n
        src = _global(e.src_rank, m, hkv, e.src_head_offset, e.num_heads)
        dst = _global(e.dst_rank, n, hkv, e.dst_head_offset, e.num_heads)
        assert src == dst


@pytest.mark.parametrize(("m", "n", "hkv"), COMBOS, ids=COMBO_IDS)
def test_the_plan_is_deterministic_sorted_and_fully_merged(m: int, n: int, hkv: int) -> None:
    """Both engines compute it apart, and any unmerged neighbour would cost a write per chunk."""
    first = plan(m, n, hkv)
    assert first == plan(m, n, hkv)
    assert list(first) == sorted(first, key=lambda e: (e.dst_rank, e.dst_head_offset))
    for a, b in itertools.pairwise(first):
        mergeable = (
            (a.src_rank, a.dst_rank) == (b.src_rank, b.dst_rank)
            and a.src_head_offset + a.num_heads == b.src_head_offset
            and a.dst_head_offset + a.num_heads == b.dst_head_offset
        )
        assert not mergeable, (a, b)


@pytest.mark.parametrize(("m", "n", "hkv"), COMBOS, ids=COMBO_IDS)
def test_writes_per_chunk_is_max_of_min_m_hkv_and_n(m: int, n: int, hkv: int) -> None:
    """The design note's count formula holds for every power-of-two pair (checked exhaustively)."""
    assert writes_per_chunk(plan(m, n, hkv)) == len(plan(m, n, hkv)) == max(min(m, hkv), n)


@pytest.mark.parametrize(("m", "n", "hkv"), COMBOS, ids=COMBO_IDS)
def test_sources_of_lists_each_decode_ranks_writers(m: int, n: int, hkv: int) -> None:
    """Decode counts last-chunk notifs per source, so S(d) must be exactly the entries' sources;
    its size follows the design note's max(1, min(M, Hkv) / N)."""
    transfer_plan = plan(m, n, hkv)
    for d in range(n):
        expected = frozenset(e.src_rank for e in transfer_plan if e.dst_rank == d)
        assert sources_of(transfer_plan, d) == expected
        assert len(expected) == max(1, min(m, hkv) // n)
    assert sources_of(transfer_plan, n) == frozenset()


def test_p1_to_d1_is_one_whole_page_entry() -> None:
    """Same layout on both ends: one write per chunk, page runs coalesce."""
    assert plan(1, 1, 8) == (PlanEntry(0, 0, 0, 0, 8),)


def test_p2_to_d2_copies_each_rank_to_its_twin_whole() -> None:
    """Homogeneous TP is the identity plan."""
    assert plan(2, 2, 8) == (PlanEntry(0, 0, 0, 0, 4), PlanEntry(1, 1, 0, 0, 4))


def test_p2_to_d1_stacks_both_prefill_halves_into_decode_rank_0() -> None:
    """s1 sends its local heads 0-3 (global 4-7) to d0's offset 4."""
    assert plan(2, 1, 8) == (PlanEntry(0, 0, 0, 0, 4), PlanEntry(1, 0, 0, 4, 4))
    assert sources_of(plan(2, 1, 8), 0) == frozenset({0, 1})


def test_p1_to_d4_slices_prefill_pages_into_whole_decode_pages() -> None:
    """s0's heads 2j..2j+1 fill all of dj."""
    assert plan(1, 4, 8) == tuple(PlanEntry(0, j, 2 * j, 0, 2) for j in range(4))


def test_p1_to_d4_with_two_kv_heads_sends_each_head_twice() -> None:
    """Replicated decode heads each get their own copy on the wire (wire bytes x2)."""
    assert plan(1, 4, 2) == (
        PlanEntry(0, 0, 0, 0, 1),
        PlanEntry(0, 1, 0, 0, 1),
        PlanEntry(0, 2, 1, 0, 1),
        PlanEntry(0, 3, 1, 0, 1),
    )


def test_p4_to_d1_with_two_kv_heads_reads_one_replica_per_head() -> None:
    """s0 and s2 are the first replicas of heads 0 and 1; s1 and s3 hold duplicates and idle."""
    assert plan(4, 1, 2) == (PlanEntry(0, 0, 0, 0, 1), PlanEntry(2, 0, 0, 1, 1))
    assert sources_of(plan(4, 1, 2), 0) == frozenset({0, 2})


def test_replicated_pairs_spread_decode_replicas_over_prefill_replicas() -> None:
    """P4->D4, Hkv=2: d0, d1 are replicas 0, 1 of head 0 and read s0, s1 (replicas 0, 1 of head 0);
    d2, d3 read s2, s3 the same way. So all 4 prefill ranks write, one entry each, no one idles.
    With fewer prefill replicas (P2->D4, Hkv=1) the index wraps: d0, d2 read s0 and d1, d3 read s1.
    """
    spread = plan(4, 4, 2)
    assert spread == tuple(PlanEntry(r, r, 0, 0, 1) for r in range(4))
    assert {e.src_rank for e in spread} == {0, 1, 2, 3}
    assert [e.src_rank for e in plan(2, 4, 1)] == [0, 1, 0, 1]


def test_head_ownership_splits_then_replicates() -> None:
    """The sharding rules the model, the pool and the plan all share."""
    assert [kv_heads_of_rank(r, 4, 8) for r in range(4)] == [range(0, 2), range(2, 4),
                                                              range(4, 6), range(6, 8)]  # fmt: skip
    assert [kv_heads_of_rank(r, 8, 2) for r in range(8)] == [range(0, 1)] * 4 + [range(1, 2)] * 4
    assert ranks_holding_head(1, 8, 2) == range(4, 8)
    assert ranks_holding_head(5, 4, 8) == range(2, 3)


@pytest.mark.parametrize(("tp", "hkv"), list(itertools.product(SIZES, SIZES)))
def test_ranks_holding_head_is_the_inverse_of_kv_heads_of_rank(tp: int, hkv: int) -> None:
    """The plan picks sources with one and computes offsets with the other; they must agree."""
    for head in range(hkv):
        holders = [r for r in range(tp) if head in kv_heads_of_rank(r, tp, hkv)]
        assert list(ranks_holding_head(head, tp, hkv)) == holders


@pytest.mark.parametrize(("tp", "hkv"), [(3, 8), (6, 8), (5, 2), (3, 2), (16, 12), (4, 6)])
def test_uneven_head_sharing_is_refused_naming_both_numbers(tp: int, hkv: int) -> None:
    """An uneven split would give ranks different pool shapes; say which sizes clash."""
    with pytest.raises(ValueError, match=rf"tp_size={tp}.*num_kv_heads={hkv}"):
        check_tp_kv_heads(tp, hkv)
    with pytest.raises(ValueError, match=rf"prefill_tp={tp}.*num_kv_heads={hkv}"):
        plan(tp, 1, hkv)
    with pytest.raises(ValueError, match=rf"decode_tp={tp}.*num_kv_heads={hkv}"):
        plan(1, tp, hkv)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2", None])
@pytest.mark.parametrize("name", ["prefill_tp", "decode_tp", "num_kv_heads"])
def test_plan_refuses_a_size_that_is_not_a_positive_int(name: str, bad: object) -> None:
    """A bool or float size is a caller bug; the error names the argument to fix."""
    sizes: dict[str, object] = {"prefill_tp": 2, "decode_tp": 2, "num_kv_heads": 8, name: bad}
    with pytest.raises(ValueError, match=name):
        plan(**sizes)  # type: ignore[arg-type]


@pytest.mark.parametrize("rank", [-1, 4, True])
def test_kv_heads_of_rank_refuses_a_rank_outside_the_group(rank: int) -> None:
    """Rank 4 of 4 would silently get heads past the end."""
    with pytest.raises(ValueError, match="rank"):
        kv_heads_of_rank(rank, 4, 8)


def test_plan_entries_are_frozen() -> None:
    """Plans are shared by both sides' room tables; an entry edited in place would desync them."""
    entry = plan(1, 1, 8)[0]
    with pytest.raises(AttributeError):
        entry.num_heads = 4  # type: ignore[misc]
