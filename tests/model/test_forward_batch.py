"""Batch building: one host buffer per batch, padding on the scratch page, packed extends."""

from __future__ import annotations

import torch

from pdserve.model.forward_batch import (
    ForwardBatch,
    decode_batch,
    decode_values,
    extend_batch,
    mixed_batch,
)
from pdserve.sequence import Sequence

PAGE, SCRATCH = 4, 99
CPU = torch.device("cpu")


def _seq(num_tokens: int, pages: list[int], cached: int = 0) -> Sequence:
    return Sequence("s", list(range(100, 100 + num_tokens)), num_tokens, page_ids=pages,
                    num_cached_tokens=cached)  # fmt: skip


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_decode_batch_is_one_tensor_with_the_layout_fields_as_views() -> None:
    seqs = [_seq(5, [7, 3]), _seq(9, [1, 8, 4])]
    batch = decode_batch(seqs, PAGE, SCRATCH, CPU)
    assert batch.is_decode and batch.num_seqs == 2
    fields = [batch.input_ids, batch.positions, batch.context_lens, batch.page_idx,
              batch.page_offset, batch.block_table, batch.block_table_width]  # fmt: skip
    assert len({_storage(t) for t in fields}) == 1
    assert batch.input_ids.tolist() == [104, 108]
    assert batch.positions.tolist() == [4, 8]
    assert batch.context_lens.tolist() == [5, 9]
    assert batch.page_idx.tolist() == [3, 4]  # the page of position 4 and of position 8
    assert batch.page_offset.tolist() == [0, 0]
    # The shorter table is padded with the scratch page, never with a live page (0).
    assert batch.block_table.tolist() == [[7, 3, SCRATCH], [1, 8, 4]]
    assert batch.block_table_width.tolist() == [3]
    assert (batch.min_context_len, batch.max_context_len) == (5, 9)


def test_padded_decode_rows_decode_on_the_scratch_page() -> None:
    values, width = decode_values([_seq(6, [2, 5])], PAGE, SCRATCH, num_rows=3)
    assert width == 2
    ids, positions, lens, pages, offsets = (values[3 * i : 3 * i + 3] for i in range(5))
    assert ids == [105, 0, 0] and positions == [5, 0, 0] and lens == [6, 1, 1]
    assert pages == [5, SCRATCH, SCRATCH] and offsets == [1, 0, 0]
    assert values[15] == width
    assert values[16:] == [2, 5] + [SCRATCH] * 4


def test_extend_batch_packs_uncached_tokens_with_their_slots() -> None:
    seqs = [_seq(3, [6]), _seq(7, [2, 9], cached=5)]
    batch, last_rows = extend_batch(seqs, PAGE, SCRATCH, CPU)
    assert not batch.is_decode
    assert batch.input_ids.tolist() == [100, 101, 102, 105, 106]
    assert batch.positions.tolist() == [0, 1, 2, 5, 6]
    assert batch.page_idx.tolist() == [6, 6, 6, 9, 9]
    assert batch.page_offset.tolist() == [0, 1, 2, 1, 2]
    assert batch.q_starts.tolist() == [0, 3]
    assert batch.num_new.tolist() == [3, 2] and batch.num_cached.tolist() == [0, 5]
    assert batch.max_new == 3
    assert batch.block_table.tolist() == [[6, SCRATCH], [2, 9]]
    assert last_rows.tolist() == [2, 4]
    meta = batch.prefill_seqs[1]
    assert (meta.q_start, meta.num_new, meta.num_cached) == (3, 2, 5)
    assert meta.page_ids.tolist() == [2, 9]
    assert _storage(meta.page_ids) == _storage(batch.input_ids)  # a view, not a copy


def test_a_mixed_steps_decode_fields_are_aligned_as_in_a_decode_step_whatever_the_chunk() -> None:
    """Triton specialises on pointer alignment (16 bytes): a decode part at an odd int64 offset
    (half the chunk lengths) would compile another variant of the decode kernel in the middle
    of serving (and inside a timed step)."""
    rows = [_seq(6, [2, 5]), _seq(3, [7])]

    def aligned(b: ForwardBatch) -> list[bool]:
        fields = (b.input_ids, b.context_lens, b.page_idx, b.block_table, b.block_table_width)
        return [f.data_ptr() % 16 == 0 for f in fields]

    want = aligned(decode_batch(rows, PAGE, SCRATCH, CPU))
    for chunk in (3, 4, 5, 6):  # extend layouts of odd and even lengths
        batch, _ = mixed_batch([_seq(chunk, [11, 12])], rows, PAGE, SCRATCH, CPU)
        assert batch.parts is not None
        dec = batch.parts[1]
        assert aligned(dec) == want, chunk
        assert dec.context_lens.tolist() == [6, 3] and dec.block_table_width.tolist() == [2]
        assert dec.block_table.tolist() == [[2, 5], [7, SCRATCH]]
