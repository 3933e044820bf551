"""Model runner speed vs `transformers` on the same weights (issue 3's reference configs).

Run: ``python bench/model_bench.py [--configs tiny,small] [--batches 1,8,32]``. For each config
it writes a random-weight Llama checkpoint (bf16, vocab 32000, head_dim 64), then measures with
a 128-token prompt and 128 new tokens:

* batch 1 decode latency, ms/token (median step): pdserve ``ModelRunner.decode`` vs a bare
  transformers loop feeding ``past_key_values``, steps interleaved so that both sides see the
  same machine load; pdserve's step split into model forward (embed..logits) and Python
  (batch building, sampling, result conversion);
* batch N throughput, generated tokens/s including prefill: ``pdserve.generate.generate`` vs
  ``transformers`` ``model.generate`` (greedy, no early stop).
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

from pdserve.generate import generate
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


@dataclass
class Row:
    config: str
    metric: str
    pdserve: float
    transformers: float
    unit: str

    @property
    def speedup(self) -> float:
        if self.unit == "ms/token":
            return self.transformers / self.pdserve
        return self.pdserve / self.transformers


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


def _prompt(batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, 32000, (batch, PROMPT_LEN), generator=gen).tolist()


class _PdserveDecoder:
    """pdserve at batch 1: one prefilled sequence, stepped one decode at a time."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        pages = runner.kv_config.pages_for(PROMPT_LEN + NEW_TOKENS + 1)
        [prompt] = _prompt(1)
        greedy = SamplingParams(temperature=0)
        self.seq = Sequence("b", list(prompt), PROMPT_LEN, greedy, list(range(pages)))
        self.seq.token_ids.append(runner.prefill([self.seq]).token_ids[0])
        self.model_ms: list[float] = []

    def step(self) -> None:
        self.seq.num_cached_tokens = self.seq.num_tokens - 1
        self.seq.token_ids.append(self.runner.decode([self.seq]).token_ids[0])
        self.model_ms.append(self.runner.stats.last_step["forward_s"] * 1e3)


class _TransformersDecoder:
    """The reference at batch 1: a bare greedy loop feeding ``past_key_values``."""

    def __init__(self, model: Any) -> None:
        self.model = model
        with torch.inference_mode():
            out = model(torch.tensor(_prompt(1)), use_cache=True)
        self.past, self.token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    def step(self) -> None:
        with torch.inference_mode():
            out = self.model(self.token, past_key_values=self.past, use_cache=True)
        self.past, self.token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)


def decode_latency(runner: ModelRunner, model: Any) -> tuple[float, float, dict[str, float]]:
    """Median ms/token of both sides at batch 1, steps interleaved so both see the same load."""
    ours, ref = _PdserveDecoder(runner), _TransformersDecoder(model)
    ours_ms, ref_ms = [], []
    for _ in range(NEW_TOKENS):
        for side, times in ((ours, ours_ms), (ref, ref_ms)):
            start = time.perf_counter()
            side.step()
            times.append((time.perf_counter() - start) * 1e3)
    step, model_ms = statistics.median(ours_ms), statistics.median(ours.model_ms)
    split = {"step_ms": step, "model_ms": model_ms, "python_ms": step - model_ms}
    return step, statistics.median(ref_ms), split


def pdserve_throughput(runner: ModelRunner, batch: int) -> float:
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = generate(runner, _prompt(batch), sampling)
    elapsed = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / elapsed


def transformers_throughput(model: Any, batch: int) -> float:
    ids = torch.tensor(_prompt(batch))
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0,
        )  # fmt: skip
    elapsed = time.perf_counter() - start
    return (out.shape[1] - PROMPT_LEN) * batch / elapsed


def bench_config(
    root: Path, name: str, batches: list[int], repeats: int
) -> tuple[list[Row], dict[str, float]]:
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(root, name)
    runner = ModelRunner(
        RunnerConfig(str(path), dtype="bfloat16", kv_cache_bytes=256 << 20, max_num_seqs=64)
    )
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    decode_latency(runner, reference)  # warm-up: one-off allocations on both sides
    ours, ref, split = decode_latency(runner, reference)
    rows = [Row(name, "decode batch 1", ours, ref, "ms/token")]
    for batch in (b for b in batches if b > 1):
        # Interleaved repeats, best of each: the least disturbed run of a shared machine.
        ours_runs, ref_runs = [], []
        for _ in range(repeats):
            ours_runs.append(pdserve_throughput(runner, batch))
            ref_runs.append(transformers_throughput(reference, batch))
        rows.append(Row(name, f"generate batch {batch}", max(ours_runs), max(ref_runs), "tok/s"))
    return rows, split


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--configs", default="tiny,small")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=1, help="throughput runs per side")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"prompt {PROMPT_LEN}, new tokens {NEW_TOKENS}, bf16")  # fmt: skip
    print(f"{'config':6} {'metric':18} {'pdserve':>10} {'transformers':>13} {'unit':9} speedup")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs.split(","):
            rows, split = bench_config(Path(tmp), name, batches, args.repeats)
            for r in rows:
                print(f"{r.config:6} {r.metric:18} {r.pdserve:10.2f} {r.transformers:13.2f} "
                      f"{r.unit:9} {r.speedup:.2f}x")  # fmt: skip
            print(f"{name:6} decode step split  model {split['model_ms']:.2f} ms + "
                  f"python {split['python_ms']:.2f} ms = {split['step_ms']:.2f} ms")  # fmt: skip
            results.append(
                {"rows": [vars(r) | {"speedup": r.speedup} for r in rows], "split": split}
            )
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
