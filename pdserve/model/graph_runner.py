"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step launches a few kernels per layer; at small batches the GPU waits on the CPU's
launches. One graph per bucket of batch sizes (1, 2, 4, 8, then steps of 8 to 64 and of 16
beyond, up to ``max_num_seqs``) replays the whole forward with one launch. The graphs read one
static input buffer in the decode layout of :mod:`pdserve.model.forward_batch` and write one
static hidden-state buffer; a step copies its inputs in (one host-to-device copy), pads the
rows up to the bucket onto the pool's scratch page, replays, and hands back the real rows.
All graphs share one memory pool (they never run at the same time), captured largest first.

The page tables stay on the device between steps (:class:`~pdserve.model.block_table.
BlockTable`): a step sends each row's slot and the pages added since the last step, and the
graph gathers its full-width ``(B, W)`` table from the slots' rows. The static inputs are::

    [input_ids | positions | context_lens | page_idx | page_offset (B each) | W | slots (B) |
     table writes: flat indices (n) | pages (n)]

Without graphs (``use_graphs=False``, and always on a CPU) the same bookkeeping runs eagerly:
bucket choice, padding onto the scratch page, the static buffer refilled, the output sliced.
With a capturable backend the eager forward even runs on the very views a graph would have
been captured on (full-width table, static workspace), refilled each step: a backend that
kept a host value from capture time gives wrong results there too, which CPU CI then sees.
CPU serving does not use this class.
"""

from __future__ import annotations

import time

import torch

from pdserve.attention.backend import AttentionBackend
from pdserve.model.block_table import BlockTable
from pdserve.model.forward_batch import (
    DECODE_FIELDS,
    ForwardBatch,
    decode_batch_views,
    decode_fields,
)
from pdserve.model.llama import LlamaModel
from pdserve.sequence import Sequence


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, steps of 8 to 64, of 16 beyond; the last is
    ``max_num_seqs`` itself."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, max_num_seqs + 1, 16)]
    return [n for n in sizes if n < max_num_seqs] + [max_num_seqs]


class DecodeGraphRunner:
    """Static decode inputs and outputs, one captured graph per bucket (see the module doc)."""

    def __init__(
        self,
        model: LlamaModel,
        backend: AttentionBackend,
        max_num_seqs: int,
        max_model_len: int,
        use_graphs: bool | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        pool = backend.kv_pool
        self.device = pool.kv.device
        self.page_size = pool.config.page_size
        self.scratch_page = pool.scratch_page
        self.buckets = batch_buckets(max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.max_pages = -(-max_model_len // self.page_size)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and not (self.device.type == "cuda" and backend.supports_cuda_graph):
            raise ValueError("CUDA graphs need a CUDA device and a capturable attention backend")
        # Counted from here: the static buffers belong to the graphs' memory too.
        self._free_at_start = torch.cuda.mem_get_info(self.device)[0] if self.use_graphs else 0
        # Twice the rows a step holds: a sequence keeps its row while it misses a few steps.
        self.block_table = BlockTable(
            2 * max_num_seqs, self.max_pages, self.scratch_page, self.device
        )
        # The static inputs (see the module doc): room for the largest bucket and the most
        # table writes one step can send (every row's full width).
        size = (DECODE_FIELDS + 1) * max_num_seqs + 1 + 2 * max_num_seqs * self.max_pages
        self.inputs = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.tables = torch.zeros(max_num_seqs, self.max_pages, dtype=torch.int64,
                                  device=self.device)  # fmt: skip
        hidden_size = model.config.hidden_size
        self.hidden = torch.zeros(
            max_num_seqs, hidden_size, dtype=model.act_dtype, device=self.device
        )
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._batches: dict[int, ForwardBatch] = {}  # the views each graph was captured on
        self.graph_memory_bytes = 0
        if backend.supports_cuda_graph:
            backend.init_cuda_graph_state(max_num_seqs)

    def bucket_for(self, num_seqs: int) -> int:
        """The smallest bucket holding ``num_seqs`` rows."""
        if not 1 <= num_seqs <= self.max_num_seqs:
            raise ValueError(f"{num_seqs} sequences: a decode graph holds 1..{self.max_num_seqs}")
        return next(n for n in self.buckets if n >= num_seqs)

    def can_run(self, num_seqs: int) -> bool:
        return 1 <= num_seqs <= self.max_num_seqs

    def capture(self) -> None:
        """Capture every bucket's graph, largest first, into one shared memory pool (without
        graphs: only the capture-time views of a capturable backend)."""
        if not self.use_graphs:
            if self.backend.supports_cuda_graph:
                for bucket in self.buckets:
                    self._batches[bucket] = self._views(bucket)
            return
        pool = None
        # Every captured row decodes on the scratch page: no live page is written.
        for bucket in reversed(self.buckets):
            self._fill_padding(bucket)
            batch = self._views(bucket)
            self.backend.init_forward_metadata_capture(batch)
            self._forward(bucket, batch)  # warm-up (compiles)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bucket, batch)
            pool = graph.pool()
            self._graphs[bucket] = graph
            self._batches[bucket] = batch
        torch.cuda.synchronize(self.device)
        free_now = torch.cuda.mem_get_info(self.device)[0]
        self.graph_memory_bytes = max(0, self._free_at_start - free_now)

    def _views(self, bucket: int, min_len: int = 0, max_len: int = 0) -> ForwardBatch:
        """The decode batch of ``bucket`` rows over the static inputs, its table the gathered
        rows (``self.tables``, full width: ``W`` is always ``max_pages``)."""
        batch = decode_batch_views(self.inputs, bucket, 0, min_len, max_len)
        batch.block_table = self.tables[:bucket]
        return batch

    def _slots(self, bucket: int) -> torch.Tensor:
        start = DECODE_FIELDS * bucket + 1
        return self.inputs[start : start + bucket]

    def _forward(self, bucket: int, batch: ForwardBatch) -> None:
        """Gather the rows' tables, then the forward (both inside a captured graph)."""
        self.block_table.gather(self._slots(bucket), self.tables[:bucket])
        self.hidden[:bucket] = self.model.forward(batch, self.backend)

    def _fill_padding(self, bucket: int) -> None:
        """Inputs of ``bucket`` rows that all decode token 0 at the scratch page's slot 0."""
        values = [0] * (2 * bucket) + [1] * bucket + [self.scratch_page] * bucket + [0] * bucket
        values += [self.max_pages] + [self.block_table.pad_slot] * bucket
        self.inputs[: len(values)].copy_(torch.tensor(values, dtype=torch.int64))

    def run(self, seqs: list[Sequence]) -> tuple[float, torch.Tensor]:
        """One decode step of ``seqs``: hidden states ``(len(seqs), hidden)`` (a view of the
        static output, valid until the next step), and when the inputs were in place."""
        num_seqs = len(seqs)
        bucket = self.bucket_for(num_seqs)
        slots, index, pages = self.block_table.plan(seqs)
        values = decode_fields(seqs, self.page_size, self.scratch_page, bucket)
        values += [self.max_pages, *slots] + [self.block_table.pad_slot] * (bucket - num_seqs)
        host = torch.tensor(values + index + pages, dtype=torch.int64,
                            pin_memory=self.device.type == "cuda")  # fmt: skip
        self.inputs[: host.numel()].copy_(host, non_blocking=True)
        writes = len(values)
        self.block_table.apply(
            self.inputs[writes : writes + len(index)],
            self.inputs[writes + len(index) : writes + 2 * len(index)],
        )
        prepared = time.perf_counter()
        if bucket in self._batches:  # the captured views, refilled
            self.backend.init_forward_metadata_replay(self._batches[bucket])
            if self.use_graphs:
                self._graphs[bucket].replay()
            else:
                self._forward(bucket, self._batches[bucket])
        else:
            lens = [s.num_tokens for s in seqs] + [1] * (bucket - num_seqs)  # padding: length 1
            batch = self._views(bucket, min(lens), max(lens))
            self.backend.init_forward_metadata(batch)
            self._forward(bucket, batch)
        return prepared, self.hidden[:num_seqs]
