"""The persistent decode page table: the gathered rows equal a table rebuilt from scratch each
step, while a step sends only the pages added since the last one."""

from __future__ import annotations

import random

import torch

from pdserve.model.block_table import BlockTable
from pdserve.sequence import Sequence

PAGE, MAX_PAGES, SCRATCH = 4, 6, 99
CPU = torch.device("cpu")


def _seq(seq_id: str, num_tokens: int, pages: list[int]) -> Sequence:
    return Sequence(seq_id, [1] * num_tokens, num_tokens, page_ids=pages)


def _step(table: BlockTable, seqs: list[Sequence]) -> tuple[list[list[int]], int]:
    """One step as the graph runner runs it: the gathered rows, and how many writes it sent."""
    slots, index, pages = table.plan(seqs)
    table.apply(torch.tensor(index, dtype=torch.int64), torch.tensor(pages, dtype=torch.int64))
    out = torch.empty(len(seqs), MAX_PAGES, dtype=torch.int64)
    table.gather(torch.tensor(slots), out)
    return out.tolist(), len(index)


def _rebuilt(seqs: list[Sequence]) -> list[list[int]]:
    """What the old step built: every row in full, the scratch page after a row's pages."""
    return [s.page_ids[:MAX_PAGES] + [SCRATCH] * (MAX_PAGES - len(s.page_ids)) for s in seqs]


def test_a_known_sequence_sends_only_its_new_pages() -> None:
    table = BlockTable(4, MAX_PAGES, SCRATCH, CPU)
    a, b = _seq("a", 5, [3, 8]), _seq("b", 2, [5])
    rows, writes = _step(table, [a, b])
    assert rows == _rebuilt([a, b]) and writes == 2 * MAX_PAGES  # first sight: whole rows
    rows, writes = _step(table, [b, a])  # another order, nothing new
    assert rows == _rebuilt([b, a]) and writes == 0
    a.page_ids.append(11)  # the scheduler extends the list in place
    rows, writes = _step(table, [a, b])
    assert rows == _rebuilt([a, b]) and writes == 1


def test_a_replaced_or_rewritten_page_list_is_sent_again_in_full() -> None:
    table = BlockTable(4, MAX_PAGES, SCRATCH, CPU)
    a = _seq("a", 9, [3, 8, 2])
    _step(table, [a])
    a.page_ids = [7]  # a new list (e.g. the request restarted under the same id)
    rows, writes = _step(table, [a])
    assert rows == _rebuilt([a]) and writes == MAX_PAGES
    a.page_ids[0] = 4  # changed in place where it was already sent
    rows, writes = _step(table, [a])
    assert rows == _rebuilt([a]) and writes == MAX_PAGES


def test_rows_of_absent_sequences_are_reused_least_recently_used_first() -> None:
    table = BlockTable(2, MAX_PAGES, SCRATCH, CPU)
    a, b, c = _seq("a", 1, [1]), _seq("b", 1, [2]), _seq("c", 1, [3])
    _step(table, [a])
    _step(table, [b])
    rows, _ = _step(table, [c, b])  # no free slot: a's row (unused longest) goes to c
    assert rows == _rebuilt([c, b])
    rows, writes = _step(table, [b, a])  # a comes back: sent again, in c's old row
    assert rows == _rebuilt([b, a]) and writes == MAX_PAGES


def test_random_joins_leaves_and_growth_gather_what_a_rebuilt_table_holds() -> None:
    rng = random.Random(0)
    table = BlockTable(8, MAX_PAGES, SCRATCH, CPU)
    live: dict[str, Sequence] = {}
    next_page, next_id = 0, 0
    for _ in range(300):
        if len(live) < 4 or (len(live) < 8 and rng.random() < 0.2):
            live[f"s{next_id}"] = _seq(f"s{next_id}", 1, [next_page])
            next_id, next_page = next_id + 1, next_page + 1
        if rng.random() < 0.15:
            live.pop(rng.choice(sorted(live)))
        step = rng.sample(sorted(live.values(), key=lambda s: s.seq_id), rng.randint(1, len(live)))
        for s in step:
            s.token_ids.append(1)
            if len(s.token_ids) > len(s.page_ids) * PAGE and len(s.page_ids) < MAX_PAGES:
                s.page_ids.append(next_page)
                next_page += 1
        rows, _ = _step(table, step)
        assert rows == _rebuilt(step)
