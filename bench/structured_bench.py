"""Structured-output overhead, two ways, on the demo model (or --model DIR), CPU or --device:

1. Runner level: decode steps of a batch of B sequences, with no row constrained, one row
   constrained, and every row constrained by a JSON schema (each constrained row's matcher is
   advanced by its sampled token and handed to the filler thread, as the engine does). Reports
   ms per step, the per-token overhead of a constrained row in the step ((all-constrained -
   none) / B) and the engine loop's own part per constrained token (accept + hand-off).
   ``--serial`` also times the constrained cases with each mask filled after the forward on
   the runner's thread (no background fill), for comparison (the server level too).
2. Server level (colocated, HTTP): the TPOT of an unconstrained streaming request alone, next
   to an unconstrained and next to a constrained neighbour streaming at the same time, and the
   runner's mean decode step over each case (its step counters: the step without the loop's
   part, less noisy than the TPOT).

Each case is timed ``--rounds`` times, in turn with the others; the figures are medians.

Do not run it on a loaded machine: the figures are timings.

    python bench/structured_bench.py --quick
    python bench/structured_bench.py --batch 16 --steps 64 --tokens 128 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from unittest import mock

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from anywhere

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.grammar import GrammarCompiler, GrammarSpec, prefetch_all  # noqa: E402
from pdserve.model.demo import ensure_demo_model  # noqa: E402
from pdserve.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.sequence import Sequence  # noqa: E402
from pdserve.server import Server, ServerConfig  # noqa: E402

# Long-running: an array of short strings, so a step never meets the grammar's end.
SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 100_000}
PROMPT = "Write a list of words:"


def _runner_steps(
    runner: ModelRunner, batch: int, steps: int, constrained: int, background_fill: bool = True
) -> tuple[float, float]:
    """Median seconds per decode step with ``constrained`` of ``batch`` rows under SCHEMA, and
    the median seconds per constrained token of the engine loop's part (accept, hand-off)."""
    tok = runner.tokenizer
    compiler = GrammarCompiler(
        tok.backend.to_str(), tok.vocab_size, tok.eos_token_ids, background_fill=background_fill
    )
    spec = GrammarSpec.json_schema(SCHEMA)
    prompt = tok.encode(PROMPT)
    pages = runner.kv_config.pages_for(len(prompt) + steps + 2)
    seqs = []
    for i in range(batch):
        seq = Sequence(f"b{i}", list(prompt), len(prompt), SamplingParams(temperature=0.0))
        seq.page_ids = list(range(i * pages, (i + 1) * pages))
        if i < constrained:
            seq.grammar = compiler.compile(spec)
        seqs.append(seq)
    times, loop_times = [], []
    out = runner.prefill(seqs)
    for _ in range(steps):
        t_loop = time.perf_counter()
        for seq, token in zip(seqs, out.token_ids, strict=True):
            seq.num_cached_tokens = seq.num_tokens
            seq.token_ids.append(token)
            if seq.grammar is not None:
                seq.grammar.accept(token)
        # As the engine does: the next masks are filled on the filler thread during the forward.
        prefetch_all([s.grammar for s in seqs if s.grammar is not None])
        t0 = time.perf_counter()
        loop_times.append((t0 - t_loop) / max(constrained, 1))
        out = runner.decode(seqs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), statistics.median(loop_times)


def runner_bench(args: argparse.Namespace) -> dict[str, float]:
    model = args.model or str(ensure_demo_model())
    runner = ModelRunner(RunnerConfig(model_dir=model, device=args.device, max_num_seqs=args.batch,
                                      kv_cache_bytes=256 << 20))  # fmt: skip
    b, steps = args.batch, args.steps
    cases = {"none": (0, True), "one": (1, True), "all": (b, True)}
    if args.serial:  # the same, each mask filled on the runner's thread after the forward
        cases |= {"one_serial": (1, False), "all_serial": (b, False)}
    # Rounds of every case in turn, medians over rounds: a drift in the machine's load hits
    # every case alike.
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (constrained, background) in cases.items():
            runs[name].append(_runner_steps(runner, b, steps, constrained, background))

    def step(name: str) -> float:
        return statistics.median(r[0] for r in runs[name])

    none = step("none")
    out = {
        "batch": b,
        "step_ms_unconstrained": none * 1e3,
        "step_ms_one_constrained": step("one") * 1e3,
        "step_ms_all_constrained": step("all") * 1e3,
        "overhead_ms_per_constrained_token": (step("all") - none) / b * 1e3,
        # accept + hand-off on the engine loop, outside the step
        "loop_ms_per_constrained_token": statistics.median(r[1] for r in runs["all"]) * 1e3,
    }
    if args.serial:
        out["step_ms_one_constrained_serial"] = step("one_serial") * 1e3
        out["step_ms_all_constrained_serial"] = step("all_serial") * 1e3
        out["overhead_ms_per_constrained_token_serial"] = (step("all_serial") - none) / b * 1e3
    return out


async def _stream_tpot(http: aiohttp.ClientSession, url: str, body: dict) -> float:
    """Mean seconds between streamed content deltas after the first."""
    stamps = []
    async with http.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return statistics.mean(gaps) if gaps else float("nan")


async def server_bench(args: argparse.Namespace) -> dict[str, float]:
    model = args.model or str(ensure_demo_model())
    config = ServerConfig(
        runner=RunnerConfig(model_dir=model, device=args.device, kv_cache_bytes=128 << 20),
        engine=EngineConfig(role="colocated", model_name="bench"),
        host="127.0.0.1",
    )
    plain = {"model": "bench", "prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0,
             "ignore_eos": True}  # fmt: skip
    constrained = {**plain, "guided_json": SCHEMA}
    async with Server(config) as server, aiohttp.ClientSession() as http:
        url = server.url
        # Warm both paths: the grammar compiler's token trie (once per process) and this
        # schema's compile (once, then cached) are not what the figures measure.
        await _stream_tpot(http, url, {**plain, "max_tokens": 4})
        await _stream_tpot(http, url, {**constrained, "max_tokens": 4})
        cases: dict[str, dict | None] = {
            "tpot_ms_alone": None,
            "tpot_ms_next_to_unconstrained": plain,
            "tpot_ms_next_to_constrained": constrained,
        }
        tpots: dict[str, list[float]] = {name: [] for name in cases}
        steps: dict[str, list[float]] = {name: [] for name in cases}
        names = list(cases)
        for r in range(args.rounds):  # in turn, medians over rounds (see runner_bench)
            # Each round starts with another case: no case always follows the same one.
            for name in names[r % 3 :] + names[: r % 3]:
                neighbour = cases[name]
                streams = [_stream_tpot(http, url, plain)]
                if neighbour is not None:
                    streams.append(_stream_tpot(http, url, neighbour))
                before = _decode_steps(server)
                tpots[name].append((await asyncio.gather(*streams))[0])
                steps[name].append(_mean_step_s(before, _decode_steps(server)))
    out = {name: statistics.median(values) * 1e3 for name, values in tpots.items()}
    for name, values in steps.items():  # the runner's own decode step, without the loop's part
        out[name.replace("tpot_ms", "decode_step_ms")] = statistics.median(values) * 1e3
    return out


def _decode_steps(server: Server) -> tuple[int, float]:
    """The runner's decode (steps, seconds) so far: the counters behind ``pdserve_model_steps``
    and ``pdserve_model_step_seconds`` (prefill and mixed calls are the other phase)."""
    stats = server.engine.runner.stats
    return stats.num_decode_steps, stats.decode_seconds


def _mean_step_s(before: tuple[int, float], after: tuple[int, float]) -> float:
    steps, seconds = after[0] - before[0], after[1] - before[1]
    return seconds / steps if steps else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: demo model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per case")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per streamed request")
    parser.add_argument("--rounds", type=int, default=3, help="times each case, in turn")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument(
        "--serial", action="store_true", help="also time the runner with serial (inline) fills"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.steps, args.tokens, args.rounds = 2, 4, 8, 1
    result = {"runner": runner_bench(args), "server": asyncio.run(server_bench(args))}
    if args.serial:  # the server again, its grammar compiler's matchers filling inline
        serial = partial(GrammarCompiler, background_fill=False)
        with mock.patch("pdserve.api.grammar_service.GrammarCompiler", serial):
            again = asyncio.run(server_bench(args))
        result["server"] |= {f"{k}_serial": v for k, v in again.items()}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for section, values in result.items():
            for key, value in values.items():
                print(f"{section:7s} {key:36s} {value:9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
