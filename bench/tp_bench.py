"""Tensor-parallel cost on this machine: TP t (cores / t threads per rank) beside TP1 (all
cores), the same model, the same steps, in one run.

Run: ``python bench/tp_bench.py --model PATH.gguf [--tp 1,2] [--batches 1,8] [--reps 3]``.
Every runner is started once and kept; the timed rounds alternate between them (a drifting
box slows each alike), medians over rounds. Per batch size B it times decode steps over
B sequences of ``--prompt-len`` cached tokens, and a ``--prompt-len`` prefill; it checks that
every TP size produced the same greedy tokens (the bit-identity promise, on the bench's own
outputs). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence

GREEDY = SamplingParams(temperature=0.0)


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=gen).tolist()


def _seqs(runner: ModelRunner, batch: int, prompt_len: int, steps: int) -> list[Sequence]:
    pages = -(-(prompt_len + steps + 1) // runner.kv_config.page_size)
    vocab = runner.model_config.vocab_size
    return [
        Sequence(
            f"s{i}",
            _prompt(prompt_len, vocab, i),
            prompt_len,
            GREEDY,
            list(range(i * pages, (i + 1) * pages)),
        )  # fmt: skip
        for i in range(batch)
    ]


def _round(runner: ModelRunner, batch: int, prompt_len: int, steps: int) -> dict[str, object]:
    seqs = _seqs(runner, batch, prompt_len, steps)
    t0 = time.perf_counter()
    out = runner.prefill(seqs)
    prefill_s = time.perf_counter() - t0
    step_s = []
    for _ in range(steps):
        for s, tok in zip(seqs, out.token_ids, strict=True):
            s.num_cached_tokens = s.num_tokens
            s.token_ids.append(tok)
        t0 = time.perf_counter()
        out = runner.decode(seqs)
        step_s.append(time.perf_counter() - t0)
    tokens = [s.token_ids[prompt_len:] for s in seqs]
    return {"prefill_s": prefill_s, "step_s": statistics.median(step_s), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(t) for t in args.tp.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    pages = max(batches) * -(-(args.prompt_len + args.steps + 1) // 16) + 1
    # (TP1 alone passes no TP field: the same command times a checkout from before TP)
    runners = {
        t: ModelRunner(
            RunnerConfig(
                args.model, num_pages=pages, **({"tensor_parallel_size": t} if t > 1 else {})
            )
        )
        for t in sizes
    }
    rows: dict[str, dict[str, list[float]]] = {}
    tokens: dict[str, dict[int, object]] = {}
    try:
        for _ in range(args.reps):
            for b in batches:
                for t, runner in runners.items():
                    r = _round(runner, b, args.prompt_len, args.steps)
                    key = f"tp{t}_c{b}"
                    rows.setdefault(key, {"prefill_s": [], "step_s": []})
                    rows[key]["prefill_s"].append(float(r["prefill_s"]))  # type: ignore[arg-type]
                    rows[key]["step_s"].append(float(r["step_s"]))  # type: ignore[arg-type]
                    tokens.setdefault(f"c{b}", {})[t] = r["tokens"]
    finally:
        for runner in runners.values():
            getattr(runner, "close", lambda: None)()
    result: dict[str, object] = {
        "model": args.model, "machine": platform.processor() or platform.machine(),
        "prompt_len": args.prompt_len, "steps": args.steps, "reps": args.reps,
        "same_tokens_at_every_tp": all(
            all(v == next(iter(per.values())) for v in per.values()) for per in tokens.values()
        ),
    }  # fmt: skip
    for key, r in rows.items():
        b = int(key.split("_c")[1])
        step = statistics.median(r["step_s"])
        result[key] = {
            "decode_tok_s": round(b / step, 2),
            "decode_step_ms": round(step * 1e3, 2),
            "prefill_tok_s": round(b * args.prompt_len / statistics.median(r["prefill_s"]), 1),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
