"""What one forward needs besides the weights: token ids, positions, KV slots, page tables.

Both kinds of batch are built as one host buffer of int64 values and reach the device in one
copy (from pinned memory, asynchronously, on CUDA); every field is a view of that tensor. A
mixed step (prompt chunks and decode rows, :func:`mixed_batch`) puts the extend layout and the
decode layout in one buffer and concatenates their per-row fields on the device.

Decode layout (``B`` rows, block-table width ``W``)::

    [input_ids | positions | context_lens | page_idx | page_offset (B each) | W | table (B * W)]

Row ``b`` of the block table starts at element ``b * W`` of its region, and ``W`` itself is a
device value, so a CUDA graph captured with one table width replays steps of any other
(:mod:`pdserve.model.graph_runner`). Rows past the real sequences and table entries past a
sequence's pages point at the pool's scratch page (:attr:`KVPagePool.scratch_page`), never at
a live page. Positions are sent rather than derived from the lengths: a captured graph only
replays device work, so every input must be in the buffer it reads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from pdserve.kernels.attention import PrefillSeqMeta
from pdserve.sequence import Sequence

DECODE_FIELDS = 5  # input_ids, positions, context_lens, page_idx, page_offset
DECODE_ALIGN = 2  # int64 elements: a mixed step's decode part starts 16-byte aligned


@dataclass
class ForwardBatch:
    """One forward's inputs. ``is_decode``: one new token per sequence (``context_lens``,
    ``block_table_width``); otherwise a packed extend (prefill over an optional cached prefix:
    ``prefill_seqs``, ``q_starts``, ``num_new``, ``num_cached``), or, with ``parts``, a mixed
    step of an extend batch followed by decode rows."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    page_idx: torch.Tensor  # (T,) int64: the page each new token's K/V goes to
    page_offset: torch.Tensor  # (T,) int64: the slot inside that page
    block_table: torch.Tensor  # (B, W) int64 page ids per sequence
    is_decode: bool
    # decode
    context_lens: torch.Tensor | None = None  # (B,) int64, including the new token
    block_table_width: torch.Tensor | None = None  # (1,) int64: W, on the device
    min_context_len: int = 0  # host copies of the length range (the torch key mask)
    max_context_len: int = 0
    # extend
    prefill_seqs: list[PrefillSeqMeta] | None = None  # per sequence (the torch path)
    q_starts: torch.Tensor | None = None  # (B,) int64: first packed row of each sequence
    seq_of_row: torch.Tensor | None = None  # (T,) int64: the sequence of each packed row
    num_new: torch.Tensor | None = None  # (B,) int64
    num_cached: torch.Tensor | None = None  # (B,) int64
    max_new: int = 0  # host: the largest num_new
    # mixed (prompt chunks and decode rows in one forward): the extend batch of the first rows
    # and the decode batch of the rest; the fields above then span all rows
    parts: tuple[ForwardBatch, ForwardBatch] | None = None

    @property
    def num_seqs(self) -> int:
        return self.block_table.shape[0]


def check_seqs(seqs: list[Sequence], page_size: int, max_model_len: int, is_decode: bool) -> None:
    """ValueError unless every sequence fits the model and its pages (and a prefill has
    uncached tokens)."""
    if not seqs:
        raise ValueError("empty batch")
    for s in seqs:
        if s.num_tokens > max_model_len:
            raise ValueError(f"{s.seq_id}: {s.num_tokens} tokens > {max_model_len}")
        if len(s.page_ids) * page_size < s.num_tokens:
            raise ValueError(f"{s.seq_id}: {len(s.page_ids)} pages for {s.num_tokens} tokens")
        if not is_decode and not 0 <= s.num_cached_tokens < s.num_tokens:
            raise ValueError(
                f"{s.seq_id}: prefill needs new tokens "
                f"(cached {s.num_cached_tokens} of {s.num_tokens})"
            )


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """One int64 tensor on ``device``: built in place on a CPU, else staged in pinned memory
    and copied asynchronously (the caching host allocator keeps the buffer until the copy ran)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.int64)
    host = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    return host.to(device, non_blocking=True)


def decode_fields(
    seqs: list[Sequence], page_size: int, scratch_page: int, num_rows: int
) -> list[int]:
    """The decode layout's per-row fields (input ids, positions, lengths, the new token's page
    and slot) for ``seqs`` padded to ``num_rows`` rows: ``DECODE_FIELDS * num_rows`` ints."""
    num_pad = num_rows - len(seqs)
    assert num_pad >= 0, f"{len(seqs)} sequences do not fit {num_rows} rows"
    lens = [s.num_tokens for s in seqs]
    flat = [s.token_ids[-1] for s in seqs] + [0] * num_pad
    flat += [n - 1 for n in lens] + [0] * num_pad
    flat += lens + [1] * num_pad
    flat += [s.page_ids[(n - 1) // page_size] for s, n in zip(seqs, lens, strict=True)]
    flat += [scratch_page] * num_pad
    flat += [(n - 1) % page_size for n in lens] + [0] * num_pad
    return flat


def decode_values(
    seqs: list[Sequence], page_size: int, scratch_page: int, num_rows: int | None = None
) -> tuple[list[int], int]:
    """The decode layout's host values for ``seqs`` padded to ``num_rows`` rows, and ``W``.

    A padded row decodes token 0 at position 0 of the scratch page. The per-token values are a
    handful of ints per sequence, cheaper in Python than as a chain of small torch ops.
    """
    num_rows = num_rows or len(seqs)
    num_pad = num_rows - len(seqs)
    width = -(-max(s.num_tokens for s in seqs) // page_size)
    flat = decode_fields(seqs, page_size, scratch_page, num_rows)
    flat.append(width)
    for s in seqs:
        pages = s.page_ids[:width]
        flat += pages
        flat += [scratch_page] * (width - len(pages))
    flat += [scratch_page] * (num_pad * width)
    return flat, width


def decode_batch_views(
    data: torch.Tensor, num_rows: int, width: int, min_len: int = 0, max_len: int = 0
) -> ForwardBatch:
    """A decode :class:`ForwardBatch` whose fields are views of ``data`` (the decode layout)."""
    fields = data[: DECODE_FIELDS * num_rows].view(DECODE_FIELDS, num_rows)
    input_ids, positions, context_lens, page_idx, page_offset = fields
    table_start = DECODE_FIELDS * num_rows + 1
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        page_idx=page_idx,
        page_offset=page_offset,
        block_table=data[table_start : table_start + num_rows * width].view(num_rows, width),
        is_decode=True,
        context_lens=context_lens,
        block_table_width=data[table_start - 1 : table_start],
        min_context_len=min_len,
        max_context_len=max_len,
    )


def decode_batch(
    seqs: list[Sequence], page_size: int, scratch_page: int, device: torch.device
) -> ForwardBatch:
    """The batch of one decode step: each sequence's last token, whose K/V is not cached yet."""
    values, width = decode_values(seqs, page_size, scratch_page)
    lens = [s.num_tokens for s in seqs]
    data = to_device(values, device)
    return decode_batch_views(data, len(seqs), width, min(lens), max(lens))


def _extend_shape(seqs: list[Sequence], page_size: int) -> tuple[list[int], list[int], list[int]]:
    """Per sequence of an extend batch: pages covering it, uncached tokens, first packed row."""
    num_pages = [-(-s.num_tokens // page_size) for s in seqs]
    num_new = [s.num_tokens - s.num_cached_tokens for s in seqs]
    starts = list(itertools.accumulate(num_new[:-1], initial=0))
    return num_pages, num_new, starts


def extend_values(seqs: list[Sequence], page_size: int, scratch_page: int) -> list[int]:
    """The extend layout's host values for ``seqs``:
    ``[new token ids (T) | q_starts (B) | num_new (B) | num_cached (B) | table (B*W)]``."""
    num_pages, num_new, starts = _extend_shape(seqs, page_size)
    width = max(num_pages)
    new_ids: list[int] = []
    for s in seqs:
        new_ids.extend(s.token_ids[s.num_cached_tokens :])
    flat = new_ids + starts + num_new + [s.num_cached_tokens for s in seqs]
    for s, n in zip(seqs, num_pages, strict=True):
        flat += s.page_ids[:n]
        flat += [scratch_page] * (width - n)
    return flat


def extend_batch_views(
    data: torch.Tensor, seqs: list[Sequence], page_size: int
) -> tuple[ForwardBatch, torch.Tensor]:
    """An extend :class:`ForwardBatch` over ``data`` (the extend layout of ``seqs``), and the
    packed rows of each sequence's last token."""
    num_seqs = len(seqs)
    num_pages, num_new, starts = _extend_shape(seqs, page_size)
    num_tokens = sum(num_new)
    input_ids = data[:num_tokens]
    q_starts, new_t, cached_t = data[num_tokens : num_tokens + 3 * num_seqs].view(3, num_seqs)
    table = data[num_tokens + 3 * num_seqs :].view(num_seqs, max(num_pages))
    # position of packed row r of sequence i: r - start_i + cached_i
    row_seq = torch.repeat_interleave(
        torch.arange(num_seqs, device=data.device), new_t, output_size=num_tokens
    )
    positions = torch.arange(num_tokens, device=data.device) - (q_starts - cached_t)[row_seq]
    metas = [
        PrefillSeqMeta(starts[i], num_new[i], s.num_cached_tokens, table[i, : num_pages[i]])
        for i, s in enumerate(seqs)
    ]
    batch = ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        page_idx=table[row_seq, positions // page_size],
        page_offset=positions % page_size,
        block_table=table,
        is_decode=False,
        prefill_seqs=metas,
        q_starts=q_starts,
        seq_of_row=row_seq,
        num_new=new_t,
        num_cached=cached_t,
        max_new=max(num_new),
    )
    return batch, q_starts + new_t - 1


def extend_batch(
    seqs: list[Sequence], page_size: int, scratch_page: int, device: torch.device
) -> tuple[ForwardBatch, torch.Tensor]:
    """The packed batch of each sequence's uncached tokens, and the rows of their last tokens."""
    data = to_device(extend_values(seqs, page_size, scratch_page), device)
    return extend_batch_views(data, seqs, page_size)


def mixed_batch(
    prefill: list[Sequence],
    decode: list[Sequence],
    page_size: int,
    scratch_page: int,
    device: torch.device,
) -> tuple[ForwardBatch, torch.Tensor]:
    """One forward of prompt chunks (``prefill``, packed first) and one-token ``decode`` rows,
    from one host buffer; the rows whose logits are sampled (each prompt's last row, then
    every decode row). Attention treats the two parts apart (:attr:`ForwardBatch.parts`); the
    rest of the model sees one batch of all rows."""
    ext_values = extend_values(prefill, page_size, scratch_page)
    dec_values, width = decode_values(decode, page_size, scratch_page)
    # The decode part starts on a 16-byte boundary: Triton specialises kernels on pointer
    # alignment, and an odd int64 offset (half the chunks) would compile a second variant.
    dec_start = -(-len(ext_values) // DECODE_ALIGN) * DECODE_ALIGN
    data = to_device(ext_values + [0] * (dec_start - len(ext_values)) + dec_values, device)
    extend, last_rows = extend_batch_views(data[: len(ext_values)], prefill, page_size)
    lens = [s.num_tokens for s in decode]
    dec = decode_batch_views(data[dec_start:], len(decode), width, min(lens), max(lens))
    num_extend = extend.input_ids.shape[0]
    decode_rows = torch.arange(num_extend, num_extend + len(decode), device=data.device)
    batch = ForwardBatch(
        input_ids=torch.cat([extend.input_ids, dec.input_ids]),
        positions=torch.cat([extend.positions, dec.positions]),
        page_idx=torch.cat([extend.page_idx, dec.page_idx]),
        page_offset=torch.cat([extend.page_offset, dec.page_offset]),
        block_table=extend.block_table,
        is_decode=False,
        prefill_seqs=extend.prefill_seqs,
        parts=(extend, dec),
    )
    return batch, torch.cat([last_rows, decode_rows])
