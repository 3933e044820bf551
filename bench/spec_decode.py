"""Speculative decoding: output tok/s with and without it, acceptance, and bit-identity.

    python bench/spec_decode.py --workload codegen --methods plain,draft \\
        --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --verify-cost
    python bench/spec_decode.py --workload edit --methods plain,ngram \\
        --target qwen2.5-coder-1.5b-instruct --output-len 256
    python bench/spec_decode.py --demo ...   # the demo pair (a random draft of another seed)

For each method (``plain``: no speculation; ``ngram``: prompt lookup; ``draft``: the draft
model) one colocated worker serves the target, one at a time so they never share the cores;
each concurrency level (default 1 and 8) sends every prompt once greedy and once seeded
(temperature 0.8, top_p 0.9), non-streamed, with the token logprobs. The outputs (text, tokens
and logprobs) of every method must equal ``plain``'s: the report's ``identical`` is False (and
the exit status 1) otherwise. It reports output tok/s per level with the ratio to ``plain``, the
speculation counters from the worker's /metrics, and (``--verify-cost``) the time of a K+1-row
verify forward against a 1-row decode step of each model, measured in this process.
Workloads: ``codegen`` (chat prompts asking for functions), ``edit`` (a ~1k-token source file
to rewrite with a small change: most of the answer is in the prompt).
With ``--llama-server PATH`` (a built ``llama-server``, bench/llamacpp_ref.py) and GGUF files,
methods ``llamacpp`` (no speculation), ``llamacpp-draft`` (``--spec-type draft-simple
--model-draft``) and ``llamacpp-ngram`` (``--spec-type ngram-simple``) serve the same files under
the same client; their outputs are not pdserve's (another numerics), so they are left out of
the identity check, and their rows give the ratio of pdserve's same method to them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cluster import free_port  # noqa: E402
from bench.llamacpp_ref import LlamaServer  # noqa: E402
from bench.reuse_compare import colocated  # noqa: E402
from pdserve.model.demo import DemoShape, write_demo_model  # noqa: E402

CODEGEN = [
    "Write a Python function that parses an ISO 8601 date string without using datetime.",
    "Write a Python function that merges overlapping intervals in a list of pairs.",
    "Write a Python class implementing an LRU cache with get and put in O(1).",
    "Write a Python function that returns the longest palindromic substring of a string.",
    "Write a Python function that tokenizes an arithmetic expression and evaluates it.",
    "Write a Python function that computes the edit distance between two strings.",
    "Write a Python generator that yields the prime numbers below n (a sieve).",
    "Write a Python function that flattens an arbitrarily nested list of lists.",
]
EDIT_FILE = Path(__file__).resolve().parents[1] / "pdserve" / "engine" / "scheduler.py"
EDITS = [
    "Rename the method `_next_decode` to `_next_decode_rows` everywhere.",
    "Rename the parameter `budget` to `token_budget` everywhere.",
    "Rename the class `Batch` to `StepBatch` everywhere.",
    "Replace every `self.config.max_num_seqs` by `self.max_seqs` and add that attribute.",
]
SPEC_METRICS = ("verify_steps", "drafts", "draft_tokens", "accepted_tokens", "emitted_tokens",
                "verify_seconds")  # fmt: skip
PER_POS = "pdserve_spec_decode_accepted_tokens_per_pos_total{"


def prompts(workload: str, n: int, edit_chars: int) -> list[str]:
    if workload == "codegen":
        return [CODEGEN[i % len(CODEGEN)] for i in range(n)]
    source = EDIT_FILE.read_text()[:edit_chars]
    return [
        f"{EDITS[i % len(EDITS)]} Answer with the whole file, nothing else.\n\n```python\n"
        f"{source}\n```"
        for i in range(n)
    ]


def method_args(method: str, args: argparse.Namespace) -> list[str]:
    k = ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    if method == "ngram":
        lookup = ["--prompt-lookup-min", str(args.prompt_lookup_min),
                  "--prompt-lookup-max", str(args.prompt_lookup_max)]  # fmt: skip
        return ["--speculative-method", "ngram", *k, *lookup]
    if method == "draft":
        return ["--speculative-model", str(args.draft), *k]
    return []


async def one(
    session: aiohttp.ClientSession, url: str, prompt: str, seed: int | None, max_tokens: int
) -> dict[str, Any]:
    body = {
        "model": "bench", "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "logprobs": True, "top_logprobs": 2,
        "temperature": 0.0 if seed is None else 0.8, "top_p": 1.0 if seed is None else 0.9,
    }  # fmt: skip
    if seed is not None:
        body["seed"] = seed
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data}")
    choice = data["choices"][0]
    lps = [(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top_logprobs"]])
           for t in (choice.get("logprobs") or {}).get("content") or []]  # fmt: skip
    return {"text": choice["message"]["content"], "logprobs": lps,
            "tokens": data["usage"]["completion_tokens"]}  # fmt: skip


async def run_level(url: str, ps: list[str], concurrency: int, max_tokens: int) -> dict[str, Any]:
    jobs = [(i, p, s) for i, p in enumerate(ps) for s in (None, 1000 + i)]
    sem = asyncio.Semaphore(concurrency)
    outs: dict[str, Any] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await one(session, url, ps[0], None, 4)  # warm-up (the draft loads at its first verify)

        async def job(i: int, p: str, s: int | None) -> None:
            async with sem:
                outs[f"{i}:{s}"] = await one(session, url, p, s, max_tokens)

        t0 = time.perf_counter()
        await asyncio.gather(*(job(*j) for j in jobs))
        wall = time.perf_counter() - t0
    total = sum(o["tokens"] for o in outs.values())
    return {"outputs": outs, "output_tokens": total, "wall_s": wall, "tok_s": total / wall}


async def scrape_spec(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in SPEC_METRICS:
            if line.startswith(f"pdserve_spec_decode_{name}_total{{"):
                out[name] = float(line.rsplit(" ", 1)[1])
        if line.startswith(PER_POS):
            pos = line.split('position="', 1)[1].split('"', 1)[0]
            out[f"accepted_at_{pos}"] = float(line.rsplit(" ", 1)[1])
    return out


LLAMACPP = {"llamacpp": None, "llamacpp-draft": "draft-simple", "llamacpp-ngram": "ngram-simple"}


def llama_server(method: str, args: argparse.Namespace) -> LlamaServer:
    spec_type = LLAMACPP[method]
    return LlamaServer(
        Path(args.llama_server), Path(args.target), free_port(), num_slots=max(args.concurrency),
        context_len=4096 * max(args.concurrency),  # per slot: a ~1k-token file and its rewrite
        num_threads=args.llamacpp_threads, spec_type=spec_type,
        model_draft=Path(args.draft) if spec_type == "draft-simple" else None,
        draft_max=args.num_speculative_tokens if spec_type else None,
    )  # fmt: skip


async def bench_method(method: str, args: argparse.Namespace, ps: list[str]) -> dict[str, Any]:
    if method in LLAMACPP:
        async with llama_server(method, args) as server:
            levels = {c: await run_level(server.url, ps, c, args.output_len)
                      for c in args.concurrency}  # fmt: skip
        return {"levels": levels, "spec": {}}
    worker = [*args.worker_args.split(), *method_args(method, args)]
    async with colocated(Path(args.target), worker) as proc:
        levels = {c: await run_level(proc.url, ps, c, args.output_len) for c in args.concurrency}
        spec = await scrape_spec(proc.url)
    if spec.get("draft_tokens"):
        spec["acceptance_rate"] = spec["accepted_tokens"] / spec["draft_tokens"]
        spec["mean_accepted_length"] = spec["accepted_tokens"] / max(spec["drafts"], 1)
    return {"levels": levels, "spec": spec}


def verify_cost(model: str, k: int, context: int, repeats: int) -> dict[str, float]:
    """Median seconds of a 1-row decode step and of a K+1-row verify forward at ``context``."""
    from pdserve.model_runner import ModelRunner, RunnerConfig
    from pdserve.sampling_params import SamplingParams
    from pdserve.sequence import Sequence

    runner = ModelRunner(RunnerConfig(model, page_size=16, kv_cache_bytes=256 << 20))
    ids = [(7 * i) % 1000 + 10 for i in range(context)]
    pages = list(range(runner.kv_config.pages_for(context + k + 2)))
    seq = Sequence("cost", ids, context, SamplingParams(temperature=0), pages)
    runner.prefill([seq])
    seq.num_cached_tokens = context
    seq.token_ids.append(11)

    def timed(fn: Any) -> float:
        fn()  # warm: first-call allocations and thread start-up are not the step's
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    step = timed(lambda: runner.decode([seq]))
    chunk = Sequence("cost", seq.token_ids + [12] * k, context, seq.sampling, pages, context)
    verify = timed(lambda: runner.extend_logits([chunk]))
    return {"decode_1row_s": step, f"verify_{k + 1}rows_s": verify, "ratio": verify / step}


def report(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    plain = results.get("plain")
    out: dict[str, Any] = {"workload": args.workload, "methods": {}, "identical": True}
    for method, r in results.items():
        row: dict[str, Any] = {"spec": r["spec"]}
        ours = {"llamacpp": "plain", "llamacpp-draft": "draft", "llamacpp-ngram": "ngram"}
        for c, lv in r["levels"].items():
            if method in ours:  # another engine's numerics: pdserve's same method over it
                mine = results.get(ours[method])
                row[f"c{c}"] = {"tok_s": round(lv["tok_s"], 2), "pdserve_over_it": round(
                    mine["levels"][c]["tok_s"] / lv["tok_s"], 3) if mine else None}  # fmt: skip
                continue
            same = plain is None or lv["outputs"] == plain["levels"][c]["outputs"]
            out["identical"] = out["identical"] and same
            base = plain["levels"][c]["tok_s"] if plain else None
            row[f"c{c}"] = {"tok_s": round(lv["tok_s"], 2), "output_tokens": lv["output_tokens"],
                            "vs_plain": round(lv["tok_s"] / base, 3) if base else None,
                            "identical_to_plain": same}  # fmt: skip
        out["methods"][method] = row
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default=None, help="the target's directory or GGUF file")
    p.add_argument("--draft", default=None, help="the draft's directory or GGUF file")
    p.add_argument("--demo", action="store_true", help="the demo pair (written to a temp dir)")
    p.add_argument("--workload", choices=["codegen", "edit"], default="codegen")
    p.add_argument("--methods", default="plain,ngram,draft")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--num-requests", type=int, default=4, help="prompts (each greedy and seeded)")
    p.add_argument("--output-len", type=int, default=192)
    p.add_argument("--edit-chars", type=int, default=4000, help="edit: the file's first chars")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--worker-args", default="--kv-cache-mb 512")
    p.add_argument("--verify-cost", action="store_true", help="time K+1-row verify vs 1 row")
    p.add_argument("--verify-context", type=int, default=512)
    p.add_argument("--llama-server", default=None, help="llama-server binary (llamacpp methods)")
    p.add_argument("--llamacpp-threads", type=int, default=2)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.methods = args.methods.split(",")
    if args.demo:
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix="pdserve-spec-bench-"))
        args.target = str(write_demo_model(tmp / "target"))
        args.draft = str(write_demo_model(tmp / "draft", DemoShape(seed=7, num_layers=2)))
    drafting = {"draft", "llamacpp-draft"} & set(args.methods)
    if args.target is None or (drafting and args.draft is None):
        p.error("--target (and --draft for the draft methods) or --demo")
    if set(LLAMACPP) & set(args.methods) and not args.llama_server:
        p.error("the llamacpp methods need --llama-server")
    args.target, args.draft = model_path(args.target), model_path(args.draft)
    return args


def model_path(given: str | None) -> str | None:
    """A path as given; a name of pdserve's model table fetched (pinned hash) first."""
    if given is None or Path(given).expanduser().exists():
        return str(Path(given).expanduser()) if given else None
    from pdserve.model.fetch import fetch_model

    return str(fetch_model(name=given))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ps = prompts(args.workload, args.num_requests, args.edit_chars)
    results = {m: asyncio.run(bench_method(m, args, ps)) for m in args.methods}
    out = report(results, args)
    if args.verify_cost:
        k = args.num_speculative_tokens
        models = {"target": args.target} | ({"draft": args.draft} if args.draft else {})
        out["verify_cost"] = {
            name: verify_cost(path, k, args.verify_context, 5) for name, path in models.items()
        }
    text = json.dumps(out, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text)
    return 0 if out["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
