"""ModelRunner: batched prefill and decode of Llama-family models over the paged KV pool.

Synchronous and pure compute: the scheduler calls it from one executor thread, hands it
:class:`~pdserve.sequence.Sequence` objects and applies the returned tokens itself. The runner
keeps no per-sequence state between calls; a sequence's context is its token ids plus the K/V
already written into its pages.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from pdserve.engine.protocol import TokenLogprob
from pdserve.kernels.attention import PrefillSeqMeta, additive_mask, decode_key_mask
from pdserve.kernels.kv_cache import KVCacheConfig, KVPagePool
from pdserve.kernels.linear import auto_fp32_min_rows
from pdserve.kernels.sampling import (
    SamplerOutput,
    is_plain_greedy,
    sample,
    sampling_tensors_for,
)
from pdserve.kernels.topk import argmax_rows
from pdserve.model.config import ModelConfig
from pdserve.model.llama import ForwardBatch, LlamaModel, PagedKV
from pdserve.model.loader import load_weights
from pdserve.model.tokenizer import Tokenizer
from pdserve.sequence import Sequence
from pdserve.thread_tuning import (
    CALIBRATION_CONTEXT,
    ThreadChoice,
    choose_threads,
    time_candidates,
)

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerConfig:
    model_dir: str
    dtype: str = "bfloat16"  # "bfloat16" | "float32" (CPU); "float16" too on CUDA
    page_size: int = 16
    num_pages: int | None = None  # None: as many as fit in kv_cache_bytes
    kv_cache_bytes: int = 512 * 1024 * 1024
    max_num_seqs: int = 64
    max_prefill_tokens: int = 2048  # the offline LLM's default step budget
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    device: str = "cpu"
    num_threads: int | None = None  # torch intra-op threads of prefill; None: torch's default
    # Threads of decode steps; None: the same as prefill until calibrate_decode_threads() runs.
    decode_threads: int | None = None
    # Matmuls with at least this many rows run in float32 on float32 weight copies (2x the
    # weight memory again). None: auto (on for bf16 on CPUs without native bf16 GEMM); 0: off.
    fp32_matmul_min_rows: int | None = None
    # False for a worker that never prefills prompts (the decode role): auto then makes no
    # float32 copies where the bf16 kernel runs (see auto_fp32_min_rows).
    prefills_prompts: bool = True


@dataclass
class RunnerOutput:
    """One sampled token per input sequence, in input order.

    ``logprobs`` is None when no sequence asked for logprobs; otherwise it is aligned with the
    input and holds None for the sequences that did not ask.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None


@dataclass
class RunnerStats:
    """Plain counters for the metrics module to read at scrape time."""

    num_prefill_calls: int = 0
    num_prefill_tokens: int = 0
    num_decode_steps: int = 0
    num_decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    # The last call's split: prepare_s (batch tensors), forward_s (model), sample_s (sampling
    # and conversion to Python lists).
    last_step: dict[str, float] = field(default_factory=dict)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Map a dtype name to torch; float16 is CUDA only (CPU half matmuls are very slow)."""
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}")
    if name == "float16" and device.type == "cpu":
        raise ValueError("float16 is only supported on CUDA; use bfloat16 or float32 on CPU")
    return _DTYPES[name]


class ModelRunner:
    """Owns the model weights, tokenizer and KV page pool of one engine."""

    def __init__(self, config: RunnerConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.tokenizer = Tokenizer.from_dir(config.model_dir)
        mc = self.model_config
        self.kv_config = self._kv_config(mc)
        self.max_model_len = self._max_model_len(mc)
        weights = load_weights(config.model_dir, mc, self.dtype, config.device)
        self.model = LlamaModel(
            mc, weights, self.max_model_len, self.dtype, config.device, self._fp32_min_rows()
        )
        # The transport registers this tensor with NIXL: it is never reallocated.
        self.kv_pool = KVPagePool(self.kv_config, device=self.device)
        self._paged_kv = PagedKV.of(self.kv_pool)
        # Reused every decode step by the key mask (read only).
        max_keys = self.max_model_len + self.kv_config.page_size
        self._key_positions = torch.arange(max_keys, device=self.device)
        self._zero_mask_row = torch.zeros(max_keys, dtype=self.dtype, device=self.device)
        self.stats = RunnerStats()
        self.prefill_threads = config.num_threads or torch.get_num_threads()
        self.decode_threads = config.decode_threads or self.prefill_threads
        logger.info(
            "runner ready: %s, %s, %d KV pages x %d tokens (%.1f MiB), max_model_len %d",
            mc.architecture, self.dtype, self.kv_config.num_pages, self.kv_config.page_size,
            self.kv_config.num_pages * self.kv_config.page_bytes / 2**20, self.max_model_len,
        )  # fmt: skip

    def _kv_config(self, mc: ModelConfig) -> KVCacheConfig:
        c = self.config
        probe = KVCacheConfig(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, 1, c.page_size, self.dtype
        )
        num_pages = c.num_pages or c.kv_cache_bytes // probe.page_bytes
        if num_pages < 1:
            raise ValueError(f"kv_cache_bytes={c.kv_cache_bytes} is less than one KV page")
        return KVCacheConfig(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, num_pages, c.page_size, self.dtype
        )

    def _fp32_min_rows(self) -> int | None:
        rows = self.config.fp32_matmul_min_rows
        if rows is None:
            return auto_fp32_min_rows(self.device, self.dtype, self.config.prefills_prompts)
        return rows or None

    def _max_model_len(self, mc: ModelConfig) -> int:
        limit = min(mc.max_position_embeddings, self.kv_config.num_pages * self.kv_config.page_size)
        wanted = self.config.max_model_len or mc.max_position_embeddings
        if wanted > limit:
            logger.warning("max_model_len %d capped to %d (positions / KV capacity)", wanted, limit)
        return min(wanted, limit)

    # ----- public compute API -------------------------------------------------------------

    def prefill(self, seqs: list[Sequence]) -> RunnerOutput:
        """Compute each sequence's uncached tokens in one packed forward; sample one token each."""
        t0 = time.perf_counter()
        self._check_seqs(seqs, is_decode=False)
        self._use_threads(self.prefill_threads)
        input_ids, batch, last_rows = self._prefill_batch(seqs)
        t1 = time.perf_counter()
        hidden = self.model.forward(input_ids, batch, self._paged_kv)
        logits = self.model.logits(hidden[last_rows])
        t2 = time.perf_counter()
        out = self._sample(logits, seqs)
        st = self.stats
        st.num_prefill_calls += 1
        st.num_prefill_tokens += input_ids.shape[0]
        st.prefill_seconds += self._record(t0, t1, t2)
        return out

    def decode(self, seqs: list[Sequence]) -> RunnerOutput:
        """One decode step: each sequence's last token (K/V not yet cached) -> one new token."""
        t0 = time.perf_counter()
        self._check_seqs(seqs, is_decode=True)
        self._use_threads(self.decode_threads)
        input_ids, batch = self._decode_batch(seqs)
        t1 = time.perf_counter()
        logits = self.model.logits(self.model.forward(input_ids, batch, self._paged_kv))
        t2 = time.perf_counter()
        out = self._sample(logits, seqs)
        st = self.stats
        st.num_decode_steps += 1
        st.num_decode_tokens += len(seqs)
        st.decode_seconds += self._record(t0, t1, t2)
        return out

    def _record(self, t0: float, t1: float, t2: float) -> float:
        """Keep the last call's split (batch building / model forward / sampling); total time."""
        t3 = time.perf_counter()
        self.stats.last_step = {"prepare_s": t1 - t0, "forward_s": t2 - t1, "sample_s": t3 - t2}
        return t3 - t0

    @staticmethod
    def _use_threads(num_threads: int) -> None:
        # Per phase, from the thread that runs the forward (torch's OpenMP thread count is per
        # calling thread once set); read back each time, as other runners may share the process.
        if torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)

    def calibrate_decode_threads(self, seqs: list[Sequence]) -> ThreadChoice:
        """Time decode steps of ``seqs`` (scratch sequences with pages, prefilled here) with one
        thread and with the prefill threads; keep the choice (see pdserve.thread_tuning)."""
        self.prefill(seqs)
        for s in seqs:  # one decode position, recomputed by every timed step
            s.num_cached_tokens = s.num_tokens
            s.token_ids.append(s.token_ids[-1])
        candidates = sorted({1, self.prefill_threads})

        def set_threads(n: int) -> None:
            self.decode_threads = n

        step_s = time_candidates(lambda: self.decode(seqs), set_threads, candidates)
        choice = ThreadChoice(choose_threads(step_s), step_s)
        self.decode_threads = choice.threads
        return choice

    @property
    def calibration_tokens(self) -> int:
        """Tokens (and so pages) each calibration sequence needs, its decode position included."""
        return min(CALIBRATION_CONTEXT, self.max_model_len - 1) + 1

    def prefill_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Float32 logits ``(B, vocab)`` at each sequence's last token; writes K/V of new tokens."""
        self._check_seqs(seqs, is_decode=False)
        self._use_threads(self.prefill_threads)
        input_ids, batch, last_rows = self._prefill_batch(seqs)
        hidden = self.model.forward(input_ids, batch, self._paged_kv)
        return self.model.logits(hidden[last_rows])

    def decode_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Float32 logits ``(B, vocab)`` after each sequence's last token; writes its K/V."""
        self._check_seqs(seqs, is_decode=True)
        self._use_threads(self.decode_threads)
        input_ids, batch = self._decode_batch(seqs)
        return self.model.logits(self.model.forward(input_ids, batch, self._paged_kv))

    # ----- batch construction -------------------------------------------------------------

    def _check_seqs(self, seqs: list[Sequence], is_decode: bool) -> None:
        if not seqs:
            raise ValueError("empty batch")
        page_size = self.kv_config.page_size
        for s in seqs:
            if s.num_tokens > self.max_model_len:
                raise ValueError(f"{s.seq_id}: {s.num_tokens} tokens > {self.max_model_len}")
            if len(s.page_ids) * page_size < s.num_tokens:
                raise ValueError(f"{s.seq_id}: {len(s.page_ids)} pages for {s.num_tokens} tokens")
            if not is_decode and not 0 <= s.num_cached_tokens < s.num_tokens:
                raise ValueError(
                    f"{s.seq_id}: prefill needs new tokens "
                    f"(cached {s.num_cached_tokens} of {s.num_tokens})"
                )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _prefill_batch(
        self, seqs: list[Sequence]
    ) -> tuple[torch.Tensor, ForwardBatch, torch.Tensor]:
        page_size = self.kv_config.page_size
        new_ids: list[int] = []
        metas: list[PrefillSeqMeta] = []
        for s in seqs:
            metas.append(
                PrefillSeqMeta(
                    q_start=len(new_ids),
                    num_new=s.num_tokens - s.num_cached_tokens,
                    num_cached=s.num_cached_tokens,
                    page_ids=self._tensor(s.page_ids[: -(-s.num_tokens // page_size)]),
                )
            )
            new_ids.extend(s.token_ids[s.num_cached_tokens :])
        num_new = self._tensor([m.num_new for m in metas])
        starts = self._tensor([m.q_start for m in metas])
        cached = self._tensor([m.num_cached for m in metas])
        # position of packed row r of sequence i: r - start_i + cached_i
        row_seq = torch.repeat_interleave(torch.arange(len(seqs), device=self.device), num_new)
        positions = torch.arange(len(new_ids), device=self.device) - (starts - cached)[row_seq]
        pages = torch.cat([m.page_ids for m in metas])
        first_page = torch.cumsum(torch.tensor([0] + [len(m.page_ids) for m in metas[:-1]]), 0)
        page_idx = pages[first_page.to(self.device)[row_seq] + positions // page_size]
        batch = ForwardBatch(
            positions=positions,
            page_idx=page_idx,
            page_offset=positions % page_size,
            prefill_seqs=metas,
        )
        last_rows = starts + num_new - 1
        return self._tensor(new_ids), batch, last_rows

    def _decode_batch(self, seqs: list[Sequence]) -> tuple[torch.Tensor, ForwardBatch]:
        page_size = self.kv_config.page_size
        num_seqs = len(seqs)
        lens = [s.num_tokens for s in seqs]
        max_pages = -(-max(lens) // page_size)
        # Everything the step needs in one Python list -> one tensor, sliced into views: the
        # per-token values are a handful of ints per sequence, cheaper in Python than as a
        # chain of small torch ops. Padding entries point at page 0; the key mask hides them.
        flat = [s.token_ids[-1] for s in seqs] + lens
        flat += [s.page_ids[(n - 1) // page_size] for s, n in zip(seqs, lens, strict=True)]
        flat += [(n - 1) % page_size for n in lens]
        for s in seqs:
            pages = s.page_ids[:max_pages]
            flat += pages
            flat += [0] * (max_pages - len(pages))
        data = self._tensor(flat)
        input_ids, context_lens, page_idx, page_offset = data[: 4 * num_seqs].view(4, num_seqs)
        batch = ForwardBatch(
            positions=context_lens - 1,
            page_idx=page_idx,
            page_offset=page_offset,
            block_table=data[4 * num_seqs :].view(num_seqs, max_pages),
            context_lens=context_lens,
            # The C++ decode kernel reads context_lens itself: no mask to build.
            key_mask=None
            if self.model.decode_kernel is not None
            else self._key_mask(seqs, context_lens, max_pages * page_size),
        )
        return input_ids, batch

    def _key_mask(
        self, seqs: list[Sequence], context_lens: torch.Tensor, max_len: int
    ) -> torch.Tensor | None:
        window = self.model_config.sliding_window
        is_windowed = window is not None and max_len > window
        if not is_windowed and all(s.num_tokens == max_len for s in seqs):
            return None  # every key of every sequence is visible: no mask at all
        if is_windowed:
            return additive_mask(decode_key_mask(context_lens, max_len, window), self.dtype)
        # Additive mask in one pass: 0 where key position < length, -inf from it on.
        is_hidden = self._key_positions[:max_len] >= context_lens.unsqueeze(1)
        return self._zero_mask_row[:max_len].masked_fill(is_hidden, float("-inf"))

    # ----- sampling -----------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> RunnerOutput:
        if is_plain_greedy(seqs):
            # The common case needs no per-row parameters: skip building them.
            return RunnerOutput(token_ids=argmax_rows(logits).tolist())
        tensors = sampling_tensors_for(seqs, self.device)
        with torch.inference_mode():
            result = sample(logits, tensors)
        token_ids = result.token_ids.tolist()
        if not tensors.need_logprobs:
            return RunnerOutput(token_ids=token_ids)
        return RunnerOutput(token_ids, _token_logprobs(result, token_ids, seqs))


def _token_logprobs(
    result: SamplerOutput, token_ids: list[int], seqs: list[Sequence]
) -> list[TokenLogprob | None]:
    assert result.logprobs is not None
    chosen = result.logprobs.tolist()
    top_ids = result.top_ids.tolist() if result.top_ids is not None else None
    top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
    out: list[TokenLogprob | None] = []
    for i, s in enumerate(seqs):
        if not s.sampling.logprobs:
            out.append(None)
            continue
        n = s.sampling.top_logprobs
        top = tuple(zip(top_ids[i][:n], top_lps[i][:n], strict=True)) if top_ids and top_lps else ()
        out.append(TokenLogprob(token_id=token_ids[i], logprob=chosen[i], top=top))
    return out
