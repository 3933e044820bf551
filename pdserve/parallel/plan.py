"""Which prefill TP rank writes which KV heads into which decode TP rank.

A prefill engine with M tensor-parallel ranks and a decode engine with N ranks shard the same Hkv
KV heads differently (the tensor-parallel design note, sections 3 and 4.4). The pool is
page-head-major, so a head range of a page is one contiguous run on each rank: one transfer
entry (src rank, dst rank, offsets, head count) becomes one descriptor per page. The plan is pure
and deterministic because it is computed once per (prefill engine, decode engine) pair at
``/register`` and both sides must agree on it without talking: the prefill driver posts one write
per entry per chunk, and each decode rank waits for a last chunk from every rank in its sources.

Head ownership (the same rules the model sharding uses), Hkv KV heads, rank r of t ranks:
- t <= Hkv: Hkv % t == 0, rank r owns heads [r*Hkv/t, (r+1)*Hkv/t).
- t > Hkv: t % Hkv == 0, rank r owns the one head r*Hkv//t, replicated on t/Hkv ranks.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_positive_int(name: str, value: object) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an int >= 1 (a bool is not a size)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_tp_kv_heads(tp_size: int, num_kv_heads: int, *, name: str = "tp_size") -> None:
    """Raise ValueError unless ``tp_size`` ranks can share ``num_kv_heads`` KV heads evenly.

    Either the ranks split the heads (``num_kv_heads % tp_size == 0``) or each head is replicated
    on the same number of ranks (``tp_size % num_kv_heads == 0``). ``name`` is the argument the
    caller took the size from, so its error says which engine's size is wrong.
    """
    _check_positive_int(name, tp_size)
    _check_positive_int("num_kv_heads", num_kv_heads)
    if tp_size <= num_kv_heads and num_kv_heads % tp_size != 0:
        raise ValueError(
            f"{name}={tp_size} does not divide num_kv_heads={num_kv_heads}: "
            "the ranks cannot split the KV heads evenly"
        )
    if tp_size > num_kv_heads and tp_size % num_kv_heads != 0:
        raise ValueError(
            f"{name}={tp_size} is not a multiple of num_kv_heads={num_kv_heads}: "
            "the KV heads cannot be replicated evenly over the ranks"
        )


def _check_rank(rank: int, tp_size: int) -> None:
    """Raise ValueError unless ``rank`` is one of the ``tp_size`` ranks."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp_size:
        raise ValueError(f"rank must be an int in [0, {tp_size}), got {rank!r}")


def kv_heads_of_rank(rank: int, tp_size: int, num_kv_heads: int) -> range:
    """The global KV head ids rank ``rank`` of ``tp_size`` holds, in its local (pool) order."""
    check_tp_kv_heads(tp_size, num_kv_heads)
    _check_rank(rank, tp_size)
    if tp_size <= num_kv_heads:
        per_rank = num_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank * num_kv_heads // tp_size
    return range(head, head + 1)


def ranks_holding_head(head: int, tp_size: int, num_kv_heads: int) -> range:
    """The ranks of ``tp_size`` that hold global KV head ``head``, ascending (its replicas)."""
    check_tp_kv_heads(tp_size, num_kv_heads)
    if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < num_kv_heads:
        raise ValueError(f"head must be an int in [0, {num_kv_heads}), got {head!r}")
    if tp_size <= num_kv_heads:
        rank = head // (num_kv_heads // tp_size)
        return range(rank, rank + 1)
    replicas = tp_size // num_kv_heads
    return range(head * replicas, (head + 1) * replicas)


@dataclass(frozen=True)
class PlanEntry:
    """One contiguous head run copied from a prefill rank to a decode rank, for every page.

    Offsets are in heads, relative to each rank's own local head range: on a page-head-major page
    the run is ``num_heads * head_bytes`` bytes at ``head_offset * head_bytes``.
    """

    src_rank: int
    dst_rank: int
    src_head_offset: int
    dst_head_offset: int
    num_heads: int


def plan(prefill_tp: int, decode_tp: int, num_kv_heads: int) -> tuple[PlanEntry, ...]:
    """The transfer plan from a ``prefill_tp``-rank engine to a ``decode_tp``-rank engine.

    Every (decode rank, KV head it holds) gets exactly one source among the prefill ranks holding
    that head. Among replicas, the decode rank's index among the decode ranks holding the head,
    modulo the number of prefill replicas, picks the source, so decode replicas read from different
    prefill replicas where there are enough. Runs of heads with the same (src, dst) and contiguous
    offsets on both sides merge into one entry. Entries are sorted by (dst_rank, dst_head_offset).
    """
    _check_positive_int("prefill_tp", prefill_tp)
    _check_positive_int("decode_tp", decode_tp)
    _check_positive_int("num_kv_heads", num_kv_heads)
    check_tp_kv_heads(prefill_tp, num_kv_heads, name="prefill_tp")
    check_tp_kv_heads(decode_tp, num_kv_heads, name="decode_tp")
    entries: list[PlanEntry] = []
    for dst in range(decode_tp):
        dst_heads = kv_heads_of_rank(dst, decode_tp, num_kv_heads)
        for dst_offset, head in enumerate(dst_heads):
            dst_replica = ranks_holding_head(head, decode_tp, num_kv_heads).index(dst)
            sources = ranks_holding_head(head, prefill_tp, num_kv_heads)
            src = sources[dst_replica % len(sources)]
            src_offset = head - kv_heads_of_rank(src, prefill_tp, num_kv_heads).start
            last = entries[-1] if entries else None
            if (
                last is not None
                and (last.src_rank, last.dst_rank) == (src, dst)
                and last.src_head_offset + last.num_heads == src_offset
                and last.dst_head_offset + last.num_heads == dst_offset
            ):
                entries[-1] = PlanEntry(
                    src, dst, last.src_head_offset, last.dst_head_offset, last.num_heads + 1
                )
            else:
                entries.append(PlanEntry(src, dst, src_offset, dst_offset, 1))
    # Built in (dst_rank, dst_head_offset) order already; sorting states the contract.
    return tuple(sorted(entries, key=lambda e: (e.dst_rank, e.dst_head_offset)))


def sources_of(transfer_plan: tuple[PlanEntry, ...], dst_rank: int) -> frozenset[int]:
    """The prefill ranks decode rank ``dst_rank`` must hear a last chunk from, under the plan."""
    return frozenset(e.src_rank for e in transfer_plan if e.dst_rank == dst_rank)


def writes_per_chunk(transfer_plan: tuple[PlanEntry, ...]) -> int:
    """How many writes the prefill engine posts per chunk: one per entry."""
    return len(transfer_plan)
