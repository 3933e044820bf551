"""The decode steps' page tables, kept on the device between steps (vLLM's BlockTable, SGLang's
req_to_token_pool): one row per sequence slot, and a step sends only what changed.

Rebuilding the whole ``(B, W)`` table as a Python list every step costs B x W ints (131k at
batch 64 and 32k-token contexts) of host work and copy. Here a sequence gets a slot the first
time it decodes and its row is written then, once, in full (its pages, the scratch page after
them); later steps send only the pages it gained since, as (flat index, page) pairs. The step
then names its rows by slot, and one device gather builds the ``(B, W)`` table the kernels read.

A sequence's page list only grows while it decodes (the scheduler extends it); a list that was
replaced, or shrank, or whose last sent page changed, is sent again in full. Slots of sequences
absent from the step are reused, least recently used first, once no slot is free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.sequence import Sequence


@dataclass(slots=True)
class _Row:
    slot: int
    pages: list[int]  # the sequence's page list object, to notice a replaced one
    num_sent: int
    last_page: int  # pages[num_sent - 1] when sent, to notice one changed in place
    last_step: int


class BlockTable:
    """``num_slots`` rows of ``max_pages`` page ids on ``device``, and one more row of only
    the scratch page (:attr:`pad_slot`) for padded batch rows."""

    def __init__(
        self, num_slots: int, max_pages: int, scratch_page: int, device: torch.device
    ) -> None:
        self.num_slots, self.max_pages, self.scratch_page = num_slots, max_pages, scratch_page
        self.pad_slot = num_slots
        self.table = torch.full((num_slots + 1, max_pages), scratch_page, dtype=torch.int64,
                                device=device)  # fmt: skip
        self._rows: dict[str, _Row] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._step = 0

    def plan(self, seqs: list[Sequence]) -> tuple[list[int], list[int], list[int]]:
        """Each sequence's slot, and the table writes this step needs: flat indices and pages
        (send both with the step's inputs; :meth:`apply` writes them)."""
        self._step += 1
        if len(seqs) > self.num_slots:
            raise ValueError(f"{len(seqs)} sequences > {self.num_slots} table slots")
        in_step = {s.seq_id for s in seqs}
        slots, index, pages = [], [], []
        for s in seqs:
            row = self._rows.get(s.seq_id)
            n = min(len(s.page_ids), self.max_pages)
            start = 0
            if row is None:
                row = self._rows[s.seq_id] = _Row(self._take_slot(in_step), s.page_ids, 0, -1, 0)
            elif self._is_extension(row, s.page_ids):
                start = row.num_sent
            if start == 0:  # the whole row: its pages, then the scratch page
                new = s.page_ids[:n] + [self.scratch_page] * (self.max_pages - n)
                row.pages = s.page_ids
            else:
                new = s.page_ids[start:n]
            base = row.slot * self.max_pages + start
            index.extend(range(base, base + len(new)))
            pages.extend(new)
            row.num_sent, row.last_step = n, self._step
            row.last_page = s.page_ids[n - 1] if n else -1
            slots.append(row.slot)
        return slots, index, pages

    def apply(self, index: torch.Tensor, pages: torch.Tensor) -> None:
        """Write the planned pairs (device tensors, as sent)."""
        if index.numel():
            self.table.view(-1).index_copy_(0, index, pages)

    def gather(self, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The step's ``(B, max_pages)`` table into ``out``: row b is slot ``slots[b]``'s row
        (no host value involved, so a CUDA graph can replay it)."""
        return torch.index_select(self.table, 0, slots, out=out)

    def _is_extension(self, row: _Row, pages: list[int]) -> bool:
        sent = row.num_sent
        return (
            row.pages is pages
            and len(pages) >= sent
            and (sent == 0 or pages[sent - 1] == row.last_page)
        )

    def _take_slot(self, in_step: set[str]) -> int:
        if not self._free:  # the least recently used sequence that is not in this step
            victim = min(
                (sid for sid in self._rows if sid not in in_step),
                key=lambda sid: self._rows[sid].last_step,
            )
            self._free.append(self._rows.pop(victim).slot)
        return self._free.pop()
