"""A model runner's prompt and decode speed, for A/B runs of two code trees on one model.

Run: ``python bench/runner_speed.py --model DIR_OR_GGUF [--prompt-len 1024] [--batches 1,8]``
(``--config small|tiny``: model_bench's random-weight checkpoint instead of ``--model``). Prints
one JSON line: the prefill time of one ``--prompt-len`` prompt (TTFT without the server) and
the decode step at each batch (contexts of 256 tokens), medians of ``--reps``. To compare with
another checkout, run the same command with ``PYTHONPATH=OTHER_TREE`` in turn (interleave the
runs: the box drifts).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import orjson

# Appended, not prepended: a PYTHONPATH naming another checkout decides which pdserve runs.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence

PAGE = 16
CONTEXT = 256


def _seq(name: str, length: int, first_page: int, room: int) -> Sequence:
    pages = list(range(first_page, first_page + -(-(length + room) // PAGE)))
    ids = [(7 * i) % 30000 + 5 for i in range(length)]
    return Sequence(name, ids, length, SamplingParams(temperature=0), pages)


def _advance(seqs: list[Sequence]) -> None:
    for s in seqs:
        s.num_cached_tokens = s.num_tokens
        s.token_ids.append(5)


def measure(runner: ModelRunner, prompt_len: int, batches: list[int], reps: int) -> dict:
    steps = 8
    prefill, decode = [], {b: [] for b in batches}
    for _ in range(reps):
        start = time.perf_counter()
        runner.prefill([_seq("p", prompt_len, 0, 1)])
        prefill.append(time.perf_counter() - start)
        first = -(-(prompt_len + 1) // PAGE)
        for b in batches:
            seqs = [_seq(f"d{i}", CONTEXT, first + i * 20, steps + 1) for i in range(b)]
            runner.prefill(seqs)
            _advance(seqs)
            start = time.perf_counter()
            for _ in range(steps):
                runner.decode(seqs)
                _advance(seqs)
            decode[b].append((time.perf_counter() - start) / steps)
    # Medians, and minimums: on a shared box a neighbour only ever slows a run down, so the
    # fastest of several is the steadier figure to compare two trees by.
    return {
        "prefill_ms": round(statistics.median(prefill) * 1e3, 1),
        "prefill_min_ms": round(min(prefill) * 1e3, 1),
        "decode_step_ms": {str(b): round(statistics.median(t) * 1e3, 2) for b, t in decode.items()},
        "decode_step_min_ms": {str(b): round(min(t) * 1e3, 2) for b, t in decode.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--config", default=None, help="tiny | small: bench/model_bench's checkpoint")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from bench.model_bench import write_checkpoint

        root = Path.home() / ".cache" / "pdserve" / "bench" / "runner_speed"
        model = str(root / args.config)
        if not Path(model, "config.json").exists():
            root.mkdir(parents=True, exist_ok=True)
            write_checkpoint(root, args.config)
    batches = [int(b) for b in args.batches.split(",")]
    num_pages = -(-(args.prompt_len + 1) // PAGE) + max(batches) * 20 + 8
    runner = ModelRunner(RunnerConfig(model, dtype=args.dtype, page_size=PAGE, num_pages=num_pages,
                                      max_prefill_tokens=max(4096, args.prompt_len)))  # fmt: skip
    print(orjson.dumps({"model": model, **measure(runner, args.prompt_len, batches, args.reps)})
          .decode())  # fmt: skip


if __name__ == "__main__":
    main()
