"""ModelRunner: batched prefill and decode of Llama-family models over the paged KV pool.

Synchronous and pure compute: the scheduler calls it from one executor thread, hands it
:class:`~pdserve.sequence.Sequence` objects and applies the returned tokens itself. The runner
keeps no per-sequence state between calls; a sequence's context is its token ids plus the K/V
already written into its pages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch

from pdserve.attention.backend import AttentionConfig
from pdserve.attention.factory import create_backend
from pdserve.device import bind_device, check_device, check_gpu_memory_utilization, is_cpu
from pdserve.kernels.kv_cache import KVCacheConfig, KVPagePool
from pdserve.kernels.kv_ready import KVReady, record_kv_ready
from pdserve.kernels.prompt_logprobs import (
    prompt_logprobs_for,
    wants_prompt_logprobs,
)
from pdserve.kv_sizing import (
    CPU_DEFAULT_KV_CACHE_BYTES,
    DeviceMemory,
    KVSizing,
    device_memory,
    graph_reserve,
    measure_kv_sizing,
    sizing_lock,
    warm_up_sequences,
)
from pdserve.model.checkpoint import (
    declared_dtype,
    is_block_quantized,
    load_model_config,
    load_model_weights,
    load_tokenizer,
    release_checkpoint_file,
)
from pdserve.model.config import ModelConfig
from pdserve.model.dtype import resolve_dtype, resolve_kv_cache_dtype
from pdserve.model.forward_batch import (
    ForwardBatch,
    check_seqs,
    decode_batch,
    extend_batch,
    mixed_batch,
)
from pdserve.model.graph_runner import DecodeGraphRunner
from pdserve.model.llama import LlamaModel, activation_dtype
from pdserve.parallel.mapping import check_tp_size
from pdserve.parallel.plan import kv_heads_of_rank
from pdserve.parallel.ranks import RankLaunch, start_tensor_parallel, threads_per_rank
from pdserve.parallel.step_wire import SeqLike, Step, StepKind
from pdserve.runner_config import RunnerConfig
from pdserve.runner_output import RunnerOutput, RunnerStats
from pdserve.sampler import sample_step
from pdserve.sequence import Sequence
from pdserve.thread_tuning import (
    CALIBRATION_CONTEXT,
    ThreadChoice,
    choose_threads,
    time_candidates,
)

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model weights, tokenizer and KV page pool of one engine."""

    def __init__(self, config: RunnerConfig, rank: RankLaunch | None = None) -> None:
        if config.tensor_parallel_size > 1 and config.num_threads is None:
            config = dataclasses.replace(
                config, num_threads=threads_per_rank(config.tensor_parallel_size)
            )
        self.config = config
        self.device = check_device(config.device, "RunnerConfig.device")
        bind_device(self.device)  # warm-up and graph capture run on this thread
        if config.num_threads and is_cpu(self.device):
            torch.set_num_threads(config.num_threads)
        self.model_config = load_model_config(config.model_dir)
        declared = declared_dtype(config.model_dir, self.model_config, self.device)
        self.dtype = resolve_dtype(config.dtype, self.device, declared)
        self.act_dtype = activation_dtype(self.dtype, self.device)
        # "auto": the weights' dtype; a block-quantized GGUF under --dtype auto keeps a bf16 KV
        # cache (its dense float32 parts are a loading choice, not a precision it was made for).
        stored = self.dtype
        if config.dtype == "auto" and is_block_quantized(config.model_dir, self.model_config):
            stored = torch.bfloat16 if is_cpu(self.device) else self.dtype
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, stored, self.act_dtype)
        self.tokenizer = load_tokenizer(config.model_dir)
        mc = self.model_config
        check_tp_size(mc, config.tensor_parallel_size)
        # CUDA without an explicit size: a warm-up pool now, the real one once measured.
        memory = self._memory_to_size_from()
        self.kv_config = self._kv_config(mc, is_warm_up=memory is not None)
        self.max_model_len = self._max_model_len(mc, self.kv_config if memory is None else None)
        self.tp, self._ranks, self._shared_kv = start_tensor_parallel(
            config, self.kv_config, mc.hidden_size, rank
        )
        weights = load_model_weights(config.model_dir, mc, self.dtype, str(self.device))
        self.model = LlamaModel(
            mc, weights, self.max_model_len, self.dtype, str(self.device), self.tp
        )
        release_checkpoint_file(config.model_dir)
        if self.tp.group is not None:
            self.tp.group.barrier()  # every rank holds its shard, and has mapped the pool
        if self._ranks is not None:
            self._ranks.unlink_shared_files()
        self.stats = RunnerStats()
        self.prefill_threads = config.num_threads or torch.get_num_threads()
        self.decode_threads = config.decode_threads or self.prefill_threads
        self.graph_runner: DecodeGraphRunner | None = None
        self._build_pool()
        self.kv_sizing: KVSizing | None = None
        if memory is not None:
            self._size_pool_from_memory(memory)
        if self._use_cuda_graphs():
            self.graph_runner = DecodeGraphRunner(
                self.model, self.attn_backend, config.max_num_seqs, self.max_model_len
            )
            self.graph_runner.capture()
        if memory is not None:
            self._sizing_lock.close()  # the pool and the graphs are allocated: the next worker
        logger.info(
            "runner ready: %s, %s on %s, weights %.1f MiB, %d KV pages x %d tokens (%.1f MiB), "
            "max_model_len %d, %s attention, %s decode",
            mc.architecture, self.dtype, self.device, self.weights_bytes / 2**20,
            self.kv_config.num_pages,
            self.kv_config.page_size,
            self.kv_config.num_pages * self.kv_config.page_bytes / 2**20, self.max_model_len,
            self.attn_backend.name, "graph" if self.graph_runner else "eager",
        )  # fmt: skip

    @property
    def weights_bytes(self) -> int:
        """Memory the weights occupy as they run (quantized projections at their packed size)."""
        return self.model.num_weight_bytes

    def _build_pool(self) -> None:
        """The page pool of ``kv_config`` and the attention backend over this rank's heads."""
        # The transport registers this tensor with NIXL: it is never reallocated once serving.
        # Tensor-parallel ranks share it (every rank's heads: the TP1 page), each attending
        # over its own heads.
        self.kv_pool = KVPagePool(self.kv_config, device=self.device, storage=self._shared_kv)
        heads = kv_heads_of_rank(self.tp.rank, self.tp.size, self.model_config.num_kv_heads)
        self.attn_backend = create_backend(
            self.config.attention_backend,
            AttentionConfig.of(self.model.config, self.max_model_len, self.act_dtype),
            self.kv_pool if self.tp.size == 1 else self.kv_pool.head_view(heads),
        )

    def _memory_to_size_from(self) -> tuple[DeviceMemory, int] | None:
        """On CUDA with no explicit pool size: the device's memory and torch's allocation before
        this runner allocated anything; None where the pool has a fixed size."""
        c = self.config
        if is_cpu(self.device) or c.num_pages or c.kv_cache_bytes:
            return None
        check_gpu_memory_utilization(c.gpu_memory_utilization, "gpu_memory_utilization")
        torch.cuda.init()
        # Until this runner's memory is in place, another worker sizing a pool on this GPU would
        # count it as its own overhead (pdserve.kv_sizing); released at the end of __init__ (or,
        # if that raises, when the lock's file is closed, by the process's exit at the latest).
        self._sizing_lock = contextlib.ExitStack()
        self._sizing_lock.enter_context(sizing_lock(self.device))
        return device_memory(self.device), torch.cuda.memory_allocated(self.device)

    def _size_pool_from_memory(self, memory: tuple[DeviceMemory, int]) -> None:
        """Measure the warm-up, then replace the warm-up pool by the largest that fits."""
        info, allocated_at_start = memory
        c = self.config
        weights_bytes = torch.cuda.memory_allocated(self.device) - allocated_at_start
        weights_bytes -= self.kv_pool.storage.numel() * self.kv_pool.storage.element_size()
        sizing = measure_kv_sizing(
            self.device, info, weights_bytes, self._warm_up_largest_step,
            c.gpu_memory_utilization,
            graph_reserve(c.enforce_eager or not c.runs_decode_steps, c.graph_reserve_bytes),
            self.kv_config.page_bytes,
        )  # fmt: skip
        del self.attn_backend, self.kv_pool
        torch.cuda.empty_cache()
        self.kv_config = dataclasses.replace(self.kv_config, num_pages=sizing.num_pages)
        self.max_model_len = self._max_model_len(self.model_config, self.kv_config)
        self._build_pool()
        self.kv_sizing = sizing
        logger.info("%s: %s", self.device, sizing.describe())

    def _warm_up_largest_step(self) -> None:
        c, kv = self.config, self.kv_config
        prefill, sampled = warm_up_sequences(
            c.max_prefill_tokens, self.max_model_len, c.max_num_seqs, kv.page_size, kv.num_pages
        )
        self.prefill_logits(prefill)
        logits = torch.zeros(len(sampled), self.model_config.vocab_size, device=self.device)
        self._sample(logits, sampled)

    def _use_cuda_graphs(self) -> bool:
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and self.config.runs_decode_steps
            and self.attn_backend.supports_cuda_graph
        )

    @property
    def graph_memory_bytes(self) -> int:
        """Device memory the captured decode graphs hold (0 when decoding eagerly)."""
        return self.graph_runner.graph_memory_bytes if self.graph_runner else 0

    def _kv_config(self, mc: ModelConfig, is_warm_up: bool = False) -> KVCacheConfig:
        c = self.config
        probe = KVCacheConfig(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, 1, c.page_size, self.kv_dtype
        )
        kv_bytes = c.kv_cache_bytes or CPU_DEFAULT_KV_CACHE_BYTES
        if is_warm_up:  # enough pages for the warm-up's prefill (see _size_pool_from_memory)
            num_pages = probe.pages_for(c.max_prefill_tokens) + max(c.max_num_seqs, 1)
        else:
            num_pages = c.num_pages or kv_bytes // probe.page_bytes
        if num_pages < 1:
            raise ValueError(f"kv_cache_bytes={kv_bytes} is less than one KV page")
        return KVCacheConfig(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, num_pages, c.page_size, self.kv_dtype
        )

    def _max_model_len(self, mc: ModelConfig, kv: KVCacheConfig | None) -> int:
        """The configured length (or the model's), capped by positions and ``kv``'s capacity."""
        capacity = kv.num_pages * kv.page_size if kv is not None else mc.max_position_embeddings
        limit = min(mc.max_position_embeddings, capacity)
        wanted = self.config.max_model_len or mc.max_position_embeddings
        if wanted > limit:
            logger.warning("max_model_len %d capped to %d (positions / KV capacity)", wanted, limit)
        return min(wanted, limit)

    # ----- public compute API -------------------------------------------------------------

    def prefill(self, seqs: list[Sequence]) -> RunnerOutput:
        """Compute each sequence's uncached tokens in one packed forward; sample one token each."""
        return self.mixed(seqs, [])

    def mixed(self, prefill: list[Sequence], decode: list[Sequence]) -> RunnerOutput:
        """One forward of ``prefill``'s uncached tokens (prompt chunks) and one decode row per
        ``decode`` sequence: the weights are read once for both, and the decode rows keep the
        decode attention kernel. One token per sequence, ``prefill`` first, then ``decode``."""
        t0 = time.perf_counter()
        self._check(prefill, is_decode=False)
        if decode:
            self._check(decode, is_decode=True)
        self._use_threads(self.prefill_threads)
        batch, sample_rows = self._extend_batch(prefill, decode)
        t1 = time.perf_counter()
        hidden = self._forward(batch)
        kv_ready = record_kv_ready(self.device)  # the room's pages are written before this
        logits = self.model.logits(hidden[sample_rows])
        t2 = time.perf_counter()
        out = self._sample(logits, prefill + decode)
        out.kv_ready = kv_ready
        if any(wants_prompt_logprobs(s) for s in prefill):
            with torch.inference_mode():
                out.prompt_logprobs = prompt_logprobs_for(
                    self.model.logits, hidden, batch.prefill_seqs, prefill
                )
        st = self.stats
        st.num_prefill_calls += 1
        st.num_prefill_tokens += batch.input_ids.shape[0]
        st.prefill_seconds += st.record(t0, t1, t2)
        return out

    def decode(self, seqs: list[Sequence]) -> RunnerOutput:
        """One decode step: each sequence's last token (K/V not yet cached) -> one new token."""
        t0 = time.perf_counter()
        self._check(seqs, is_decode=True)
        self._use_threads(self.decode_threads)
        t1, hidden = self._decode_hidden(seqs)
        logits = self.model.logits(hidden)
        kv_ready = record_kv_ready(self.device)
        t2 = time.perf_counter()
        out = self._sample(logits, seqs)
        out.kv_ready = kv_ready
        st = self.stats
        st.num_decode_steps += 1
        st.num_decode_tokens += len(seqs)
        st.decode_seconds += st.record(t0, t1, t2)
        return out

    def _use_threads(self, num_threads: int) -> None:
        # Per phase, from the thread that runs the forward (torch's OpenMP thread count and the
        # current CUDA device are per calling thread); read back each time, as other runners
        # may share the process. On CUDA the host threads only launch kernels: leave torch's
        # thread count alone.
        bind_device(self.device)
        if is_cpu(self.device) and torch.get_num_threads() != num_threads:
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
        self._check(seqs, is_decode=False)
        self._use_threads(self.prefill_threads)
        batch, last_rows = self._extend_batch(seqs, [])
        return self.model.logits(self._forward(batch)[last_rows])

    def extend_logits(self, seqs: list[Sequence]) -> tuple[torch.Tensor, KVReady]:
        """Float32 logits of every uncached row of ``seqs`` (packed in order; speculation's
        verify step: pdserve.spec.verify), and the marker of their K/V writes."""
        self._check(seqs, is_decode=False)
        self._use_threads(self.prefill_threads)
        hidden = self._forward(self._extend_batch(seqs, [])[0])
        return self.model.logits(hidden), record_kv_ready(self.device)

    def decode_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """Float32 logits ``(B, vocab)`` after each sequence's last token; writes its K/V."""
        self._check(seqs, is_decode=True)
        self._use_threads(self.decode_threads)
        return self.model.logits(self._decode_hidden(seqs)[1])

    # ----- batch construction -------------------------------------------------------------

    def _check(self, seqs: list[Sequence], is_decode: bool) -> None:
        check_seqs(seqs, self.kv_config.page_size, self.max_model_len, is_decode)

    def _extend_batch(
        self, prefill: list[SeqLike], decode: list[SeqLike]
    ) -> tuple[ForwardBatch, torch.Tensor]:
        self._mirror(StepKind.EXTEND, prefill, decode)
        page_size, scratch = self.kv_config.page_size, self.kv_pool.scratch_page
        if decode:
            return mixed_batch(prefill, decode, page_size, scratch, self.device)
        return extend_batch(prefill, page_size, scratch, self.device)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.attn_backend.init_forward_metadata(batch)
        return self.model.forward(batch, self.attn_backend)

    def _decode_hidden(self, seqs: list[Sequence]) -> tuple[float, torch.Tensor]:
        """The decode step's hidden states ``(B, hidden)`` (from a graph replay where captured),
        and when the batch was built (the end of the step's prepare phase)."""
        if self.graph_runner is not None and self.graph_runner.can_run(len(seqs)):
            return self.graph_runner.run(seqs)
        self._mirror(StepKind.DECODE, [], seqs)
        batch = decode_batch(seqs, self.kv_config.page_size, self.kv_pool.scratch_page, self.device)
        t1 = time.perf_counter()
        return t1, self._forward(batch)

    # ----- tensor parallelism (pdserve.parallel) ------------------------------------------

    def _mirror(self, kind: StepKind, prefill: list[SeqLike], decode: list[SeqLike]) -> None:
        """Rank 0: every other rank runs this forward too (its collectives meet ours)."""
        if self._ranks is not None:
            self._ranks.send(kind, torch.get_num_threads(), prefill, decode)

    def follow(self, step: Step) -> None:
        """Rank r > 0: the forward rank 0 announced (pdserve.parallel.rank_main)."""
        self._use_threads(step.threads)
        if step.kind == StepKind.LOGITS:
            return self.model.join_logits(step.rows)
        if step.kind == StepKind.DECODE:
            kv = self.kv_config
            batch = decode_batch(step.decode, kv.page_size, self.kv_pool.scratch_page, self.device)
        else:
            batch = self._extend_batch(step.prefill, step.decode)[0]
        self._forward(batch)

    def close(self) -> None:
        """End this engine's other tensor-parallel ranks (nothing at TP1)."""
        if self._ranks is not None:
            self._ranks.close()
            self._ranks = None

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> RunnerOutput:
        token_ids, logprobs = sample_step(logits, seqs, self.tokenizer.eos_token_ids, self.device)
        return RunnerOutput(token_ids, logprobs)
