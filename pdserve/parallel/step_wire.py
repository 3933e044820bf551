"""A forward step as rank 0 sends it to the other tensor-parallel ranks: flat int64 values.

Each rank rebuilds the same :class:`~pdserve.model.forward_batch.ForwardBatch` from it with
the same builders rank 0 used, so the batch never needs its own wire format. What travels is
only what the builders read of a sequence: its length, cached length, page ids and the token
ids it has not cached (its last one for a decode row). No pickle: a frame is a length followed
by that many little-endian int64 values.

A LOGITS step follows a forward whenever rank 0 computes logits of ``rows`` of its hidden
states: the ranks then each compute their vocabulary shard of the LM head for those rows.

Frame: ``[kind, threads, rows, num_prefill, num_decode, seq...]`` with each seq
``[num_tokens, num_cached, num_pages, *page_ids, num_ids, *ids]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import BinaryIO, Protocol

import numpy as np


class StepKind(IntEnum):
    EXTEND = 1  # prompt chunks, optionally with decode rows (a mixed step)
    DECODE = 2
    LOGITS = 3  # the LM head over rows rank 0 hands the ranks (parallel/vocab_parallel.py)
    EXIT = 4


class SeqLike(Protocol):
    """What the batch builders read of a :class:`~pdserve.sequence.Sequence`."""

    token_ids: list[int]
    num_cached_tokens: int
    page_ids: list[int]

    @property
    def num_tokens(self) -> int: ...


@dataclass
class StepSeq:
    """A sequence as another rank sees it: the uncached tail of its token ids, behind zeros
    (the builders only read ``token_ids[num_cached_tokens:]``, or the last id of a decode row)."""

    token_ids: list[int]
    num_cached_tokens: int
    page_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Step:
    kind: StepKind
    threads: int = 1
    rows: int = 0  # LOGITS
    prefill: list[StepSeq] = field(default_factory=list)
    decode: list[StepSeq] = field(default_factory=list)


def _seq_values(s: SeqLike, is_decode: bool) -> list[int]:
    ids = s.token_ids[-1:] if is_decode else s.token_ids[s.num_cached_tokens :]
    return [s.num_tokens, s.num_cached_tokens, len(s.page_ids), *s.page_ids, len(ids), *ids]


def encode_step(
    kind: StepKind, threads: int, prefill: list[SeqLike], decode: list[SeqLike], rows: int = 0
) -> bytes:
    values = [int(kind), threads, rows, len(prefill), len(decode)]
    for s in prefill:
        values += _seq_values(s, is_decode=False)
    for s in decode:
        values += _seq_values(s, is_decode=True)
    body = np.asarray(values, dtype="<i8").tobytes()
    return np.asarray([len(values)], dtype="<i8").tobytes() + body


def _read_exact(stream: BinaryIO, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_step(stream: BinaryIO) -> Step:
    """The next step on ``stream``; EXIT at end of stream (rank 0 closed the pipe or died)."""
    head = _read_exact(stream, 8)
    if head is None:
        return Step(StepKind.EXIT)
    (n,) = np.frombuffer(head, dtype="<i8")
    body = _read_exact(stream, 8 * int(n))
    if body is None:
        return Step(StepKind.EXIT)
    v = np.frombuffer(body, dtype="<i8").tolist()
    step = Step(StepKind(v[0]), v[1], v[2])
    pos = 5
    for count, out in ((v[3], step.prefill), (v[4], step.decode)):
        for _ in range(count):
            num_tokens, num_cached, num_pages = v[pos : pos + 3]
            pages = v[pos + 3 : pos + 3 + num_pages]
            pos += 3 + num_pages
            num_ids = v[pos]
            ids = v[pos + 1 : pos + 1 + num_ids]
            pos += 1 + num_ids
            out.append(StepSeq([0] * (num_tokens - num_ids) + ids, num_cached, pages))
    return step
