"""Model runner speed vs `transformers` on the same weights (issue 3's reference configs).

Run: ``python bench/model_bench.py [--configs tiny,small] [--batches 1,8,32] [--generate]
[--sampling greedy,random,top-p,top-k-top-p]``.
For each config it writes a random-weight Llama checkpoint (bf16, vocab 32000, head_dim 64)
and, with 128-token prompts and 128 new tokens, measures:

* decode steps at batch N: pdserve ``ModelRunner.decode`` vs a bare transformers loop
  feeding ``past_key_values`` (greedy). The two sides' steps are interleaved, so a shared,
  busy machine slows both alike; medians. pdserve's step is split into model forward
  (embed..logits) and Python (batch building, sampling, conversion to lists). ``--sampling``
  picks pdserve's sampling mode (seeded; the reference stays greedy, so its column is the
  same model work): greedy, random (temperature 0.8), top-p (0.8, top_p 0.95), top-k-top-p
  (0.8, top_k 50, top_p 0.95);
* with ``--generate``: end-to-end throughput including prefill, ``pdserve.llm.LLM.generate``
  vs ``model.generate`` (best of ``--repeats`` interleaved runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.scheduler import SchedulerConfig
from pdserve.kernels import cpu_ext
from pdserve.llm import LLM
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence

PROMPT_LEN = 128
NEW_TOKENS = 128
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 512},
    "small": {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
              "num_key_value_heads": 4, "intermediate_size": 2816},
}  # fmt: skip
SAMPLING_MODES: dict[str, SamplingParams] = {
    "greedy": SamplingParams(temperature=0.0),
    "random": SamplingParams(temperature=0.8, seed=1),
    "top-p": SamplingParams(temperature=0.8, top_p=0.95, seed=1),
    "top-k-top-p": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1),
}


@dataclass
class DecodeRow:
    config: str
    sampling: str
    batch: int
    ours_ms: float  # median step
    ref_ms: float
    model_ms: float  # pdserve forward part of its step

    @property
    def speedup(self) -> float:
        return self.ref_ms / self.ours_ms

    def line(self) -> str:
        tok_s = f"{self.batch * 1e3 / self.ours_ms:8.1f} vs {self.batch * 1e3 / self.ref_ms:8.1f}"
        return (
            f"{self.config:6} {self.sampling:11} decode b={self.batch:<3} "
            f"{self.ours_ms:8.2f} {self.ref_ms:8.2f} ms/step"
            f"  {tok_s} tok/s  {self.speedup:5.2f}x   split: model {self.model_ms:.2f} + "
            f"python {self.ours_ms - self.model_ms:.2f} ms"
        )


def write_checkpoint(root: Path, name: str) -> Path:
    """Random bf16 Llama of shape ``name`` saved by transformers, plus a minimal tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM

    path = root / name
    config = LlamaConfig(vocab_size=32000, head_dim=64, max_position_embeddings=2048,
                         **SHAPES[name])  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(path))
    vocab = {f"t{i}": i for i in range(256)} | {"<unk>": 256}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    return path


def _prompts(batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, 32000, (batch, PROMPT_LEN), generator=gen).tolist()


class _PdserveDecoder:
    """pdserve: ``batch`` prefilled sequences, stepped one decode at a time."""

    def __init__(self, runner: ModelRunner, batch: int, sampling: SamplingParams) -> None:
        self.runner = runner
        num_pages = runner.kv_config.pages_for(PROMPT_LEN + NEW_TOKENS + 1)
        self.seqs = [
            Sequence(
                f"b{i}", p, PROMPT_LEN, sampling, list(range(i * num_pages, (i + 1) * num_pages))
            )
            for i, p in enumerate(_prompts(batch))
        ]
        self._apply(runner.prefill(self.seqs).token_ids)
        self.model_ms: list[float] = []

    def _apply(self, tokens: list[int]) -> None:
        for seq, token in zip(self.seqs, tokens, strict=True):
            seq.num_cached_tokens = seq.num_tokens
            seq.token_ids.append(token)

    def step(self) -> None:
        self._apply(self.runner.decode(self.seqs).token_ids)
        self.model_ms.append(self.runner.stats.last_step["forward_s"] * 1e3)


class _TransformersDecoder:
    """The reference: a bare greedy loop feeding ``past_key_values`` (no padding needed)."""

    def __init__(self, model: Any, batch: int) -> None:
        self.model = model
        with torch.inference_mode():
            out = model(torch.tensor(_prompts(batch)), use_cache=True)
        self.past, self.token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    def step(self) -> None:
        with torch.inference_mode():
            out = self.model(self.token, past_key_values=self.past, use_cache=True)
        self.past, self.token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)


def decode_steps(
    runner: ModelRunner, model: Any, name: str, batch: int, sampling: str = "greedy"
) -> DecodeRow:
    """Median step time of both sides at ``batch``, their steps interleaved."""
    ours = _PdserveDecoder(runner, batch, SAMPLING_MODES[sampling])
    ref = _TransformersDecoder(model, batch)
    ours_ms, ref_ms = [], []
    for _ in range(NEW_TOKENS):
        for side, times in ((ours, ours_ms), (ref, ref_ms)):
            start = time.perf_counter()
            side.step()
            times.append((time.perf_counter() - start) * 1e3)
    return DecodeRow(
        name, sampling, batch, statistics.median(ours_ms), statistics.median(ref_ms),
        statistics.median(ours.model_ms),
    )  # fmt: skip


def pdserve_generate(runner: ModelRunner, batch: int) -> float:
    """Generated tokens/s of the offline generate loop, prefill included."""
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # No prefix caching: every timed run computes its prompts, as transformers' does.
    with LLM(runner, SchedulerConfig(max_num_seqs=batch, prefix_caching=False)) as llm:
        start = time.perf_counter()  # engine start-up (warm-up, thread calibration) not timed
        results = llm.generate(_prompts(batch), sampling)
        return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)


def transformers_generate(model: Any, batch: int) -> float:
    ids = torch.tensor(_prompts(batch))
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0,
        )  # fmt: skip
    return (out.shape[1] - PROMPT_LEN) * batch / (time.perf_counter() - start)


def bench_config(root: Path, name: str, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(root, name)
    runner = ModelRunner(
        RunnerConfig(str(path), dtype="bfloat16", kv_cache_bytes=512 << 20, max_num_seqs=64)
    )
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    decode_steps(runner, reference, name, 1)  # warm-up: one-off allocations on both sides
    result: dict[str, Any] = {"config": name, "decode": [], "generate": []}
    for sampling in args.sampling:
        for batch in args.batches:
            row = decode_steps(runner, reference, name, batch, sampling)
            print(row.line(), flush=True)
            result["decode"].append(vars(row) | {"speedup": row.speedup})
    for batch in args.batches if args.generate else []:
        # Interleaved repeats, best of each: the least disturbed run on a shared machine.
        ours, ref = [], []
        for _ in range(args.repeats):
            ours.append(pdserve_generate(runner, batch))
            ref.append(transformers_generate(reference, batch))
        print(f"{name:6} generate b={batch:<3} {max(ours):8.1f} {max(ref):8.1f} tok/s "
              f"{max(ours) / max(ref):5.2f}x", flush=True)  # fmt: skip
        result["generate"].append({"batch": batch, "ours_tok_s": max(ours), "ref_tok_s": max(ref)})
    return result


def _int_list(text: str) -> list[int]:
    return [int(b) for b in text.split(",")]


def _modes(text: str) -> list[str]:
    modes = text.split(",")
    unknown = [m for m in modes if m not in SAMPLING_MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown sampling mode(s) {unknown}")
    return modes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default="tiny,small")
    parser.add_argument(
        "--batches", default="1,8,32", type=lambda s: [int(b) for b in s.split(",")]
    )
    parser.add_argument(
        "--sampling", default="greedy", type=_modes, help=f"any of {','.join(SAMPLING_MODES)}"
    )
    parser.add_argument("--generate", action="store_true", help="also end-to-end generate")
    parser.add_argument("--repeats", type=int, default=2, help="generate runs per side")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--json", help="write results to this file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = "on" if cpu_ext.load() is not None else "off (torch fallback)"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16, prompt "
          f"{PROMPT_LEN}, new tokens {NEW_TOKENS}, C++ CPU kernels {kernels}; "
          f"columns: pdserve, transformers")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        results = [bench_config(Path(tmp), n, args) for n in args.configs.split(",")]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
