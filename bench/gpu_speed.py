"""Speed figures of bench/gpu_check.py: memory bandwidth, pdserve decode steps, HF `generate`.

Each function returns a JSON-ready dict; nothing here prints or decides pass/fail. Timing uses
CUDA events where the device is CUDA (the host clock otherwise), after warm-up runs; HF's steps
are timed on the host clock as its tokens reach the host (each one a device-to-host copy that
waits for its step).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdserve.kernels.kv_cache import PageAllocator
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence

MIXED_REPEATS = 3  # timed repeats of each chunked-prefill mixed step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_s(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Wall seconds of each of ``repeats`` calls, the device drained before and after each."""
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def copy_bandwidth(device: str, num_bytes: int, repeats: int = 10) -> dict[str, Any]:
    """Device-to-device copy bandwidth (bytes read + written per second): the floor's HBM
    bandwidth, measured rather than taken from a data sheet."""
    dev = torch.device(device)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=dev)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = min(_timed_s(lambda: dst.copy_(src), dev, repeats))
    return {"bytes": num_bytes, "best_s": best, "bytes_per_s": 2 * num_bytes / best}


def weight_bytes_per_step(runner: ModelRunner) -> int:
    """Bytes a decode step must read: every weight except the embedding table (a step reads
    only its batch's rows of that)."""
    w = runner.model.weights
    tensors = [w.norm, w.lm_head]
    for layer in w.layers:
        tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def decode_steps(
    model_dir: Path, device: str, batches: list[int], context: int, steps: int, bandwidth: float
) -> dict[str, Any]:
    """Median pdserve decode step per batch size, next to the weight-bytes / bandwidth floor."""
    max_batch = max(batches)
    runner = ModelRunner(
        RunnerConfig(str(model_dir), device=device, max_num_seqs=max_batch,
                     max_prefill_tokens=max(context * max_batch, 512),
                     max_model_len=context + steps + 8, gpu_memory_utilization=0.8)
    )  # fmt: skip
    floor_s = weight_bytes_per_step(runner) / bandwidth
    out: dict[str, Any] = {"weight_bytes": weight_bytes_per_step(runner), "floor_ms": floor_s * 1e3,
                           "num_pages": runner.kv_config.num_pages, "batches": {}}  # fmt: skip
    if runner.kv_sizing is not None:
        out["kv_sizing"] = runner.kv_sizing.describe()
    gen = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    for batch in batches:
        allocator = PageAllocator(runner.kv_config.num_pages)
        seqs = []
        for i in range(batch):
            ids = torch.randint(3, vocab, (context,), generator=gen).tolist()
            pages = allocator.allocate(runner.kv_config.pages_for(context + steps + 8))
            seqs.append(Sequence(f"b{batch}-{i}", ids, context, SamplingParams(temperature=0),
                                 pages))  # fmt: skip
        median = _decode_step_s(runner, seqs, steps)
        out["batches"][str(batch)] = {
            "step_ms": median * 1e3,
            "x_floor": median / floor_s,
            "tokens_per_s": batch / median,
        }
    del runner  # its pool holds most of the device: free it before the next step loads a model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return out


def _apply(seqs: list[Sequence], token_ids: list[int]) -> None:
    for s, tok in zip(seqs, token_ids, strict=True):
        s.num_cached_tokens = s.num_tokens
        s.token_ids.append(tok)


def _decode_step_s(runner: ModelRunner, seqs: list[Sequence], steps: int) -> float:
    """Median seconds of a decode step of ``seqs`` (prefilled here), after warm-up steps."""
    _apply(seqs, runner.prefill(seqs).token_ids)
    for _ in range(3):  # warm-up (graph capture, autotuning)
        _apply(seqs, runner.decode(seqs).token_ids)
    times = _timed_s(lambda: _apply(seqs, runner.decode(seqs).token_ids), runner.device, steps)
    return statistics.median(times)


def hf_generate(
    model_dir: Path, device: str, batches: list[int], context: int, steps: int
) -> dict[str, Any]:
    """HF transformers ``generate`` (greedy, static cache, eager): the median gap between the tokens
    it hands its streamer, per batch size (the first token, after the prefill, starts the
    clock)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - the baseline only

    dev = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(dev)
    model.eval()
    vocab = model.config.vocab_size
    out: dict[str, Any] = {"batches": {}}
    for batch in batches:
        ids = torch.randint(3, vocab, (batch, context), generator=torch.Generator().manual_seed(0))
        ids = ids.to(dev)
        # disable_compile: a static cache otherwise makes generate compile the model on CUDA
        # (Inductor and CUDA graphs, minutes); the baseline is eager HF.
        kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None,
                  cache_implementation="static", disable_compile=True)  # fmt: skip

        def run(n: int, clock: _TokenClock | None = None, ids=ids, kw=kw) -> None:
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, streamer=clock, **kw)

        run(2)  # warm-up
        # Gaps between consecutive steps' tokens, not a difference of two generation lengths:
        # on a busy host that difference can come out zero or negative, a gap never does.
        clock = _TokenClock()
        for _ in range(3):
            clock.start()
            run(1 + steps, clock)
        step_s = statistics.median(clock.gaps)
        out["batches"][str(batch)] = {"step_ms": step_s * 1e3, "tokens_per_s": batch / step_s}
    return out


class _TokenClock:
    """A ``generate`` streamer that stamps each step's tokens: ``put`` gets the prompt first,
    then every new token on the host (``generate`` copies them there itself)."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self._last = 0.0
        self._num_puts = 0

    def start(self) -> None:
        self._num_puts = 0

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        self._num_puts += 1
        if self._num_puts >= 3:  # the 1st put is the prompt, the 2nd follows the prefill
            self.gaps.append(now - self._last)
        self._last = now

    def end(self) -> None:
        pass


def chunked_prefill(
    model_dir: Path, device: str, prompt_len: int, chunk: int, num_rows: int, steps: int
) -> dict[str, Any]:
    """A ``prompt_len``-token prompt prefilled whole, then in ``chunk``-token mixed steps beside
    ``num_rows`` decode rows (what the scheduler runs): its time to the last chunk against the
    whole prefill, and the mixed steps' times (the decode rows' inter-token gaps meanwhile)
    against a decode step of the rows alone. Every step is warmed up first (a first call can
    compile a kernel variant inside the timed step) and timed as a median of repeats."""
    runner = ModelRunner(
        RunnerConfig(str(model_dir), device=device, max_num_seqs=num_rows + 1,
                     max_prefill_tokens=max(prompt_len, 512),
                     max_model_len=prompt_len + steps + 64, gpu_memory_utilization=0.8)
    )  # fmt: skip
    out = _chunked_figures(runner, prompt_len, chunk, num_rows, steps)
    del runner  # its pool holds most of the device: free it before the next step loads a model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return out


def _chunked_figures(
    runner: ModelRunner, prompt_len: int, chunk: int, num_rows: int, steps: int
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    vocab, kv = runner.model_config.vocab_size, runner.kv_config
    allocator = PageAllocator(kv.num_pages)
    greedy = SamplingParams(temperature=0)
    prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
    pages = allocator.allocate(kv.pages_for(prompt_len))
    row_len = 32
    starts = range(0, prompt_len, chunk)
    num_steps = steps + 4 + len(starts) * (1 + MIXED_REPEATS)  # decode, warm-up, mixed steps
    rows = [
        Sequence(f"row{i}", torch.randint(3, vocab, (row_len,), generator=gen).tolist(), row_len,
                 greedy, allocator.allocate(kv.pages_for(row_len + num_steps + 1)))
        for i in range(num_rows)
    ]  # fmt: skip
    _apply(rows, runner.prefill(rows).token_ids)

    def whole() -> None:
        runner.prefill([Sequence("whole", prompt, prompt_len, greedy, pages)])

    whole()  # warm-up
    whole_s = statistics.median(_timed_s(whole, runner.device, 3))
    decode_s = _decode_step_s(runner, rows, steps)
    views = [Sequence("chunked", prompt[: min(s + chunk, prompt_len)],
                      min(s + chunk, prompt_len), greedy, pages, s) for s in starts]  # fmt: skip

    def mixed(view: Sequence) -> None:
        _apply(rows, runner.mixed([view], rows).token_ids[1:])

    for view in views:  # warm-up: every chunk's shapes compiled before any is timed
        mixed(view)
    # Each chunk's step, repeated (it rewrites the same K/V): the median of its repeats.
    mixed_s = [statistics.median(_timed_s(lambda v=v: mixed(v), runner.device, MIXED_REPEATS))
               for v in views]  # fmt: skip
    return {
        "prompt_len": prompt_len, "chunk": chunk, "num_rows": num_rows,
        "whole_prefill_ms": whole_s * 1e3, "chunked_total_ms": sum(mixed_s) * 1e3,
        "chunked_over_whole": sum(mixed_s) / whole_s, "decode_step_ms": decode_s * 1e3,
        "mixed_step_max_ms": max(mixed_s) * 1e3,
        "mixed_max_over_decode": max(mixed_s) / decode_s, "mixed_repeats": MIXED_REPEATS,
    }  # fmt: skip
