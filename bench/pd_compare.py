"""PD vs colocated vs a plain `transformers` loop (and vLLM), side by side in one run.

    python bench/pd_compare.py --config small --concurrency 1,8 --num-requests 16
    python bench/pd_compare.py ... --vllm-python /path/to/venv/bin/python  # adds vLLM
    python bench/pd_compare.py --config small --concurrency 8 --deployments pd,pd_secure
    python bench/pd_compare.py --config smollm2 --deployments pd,colocated \\
        --llamacpp ~/.cache/pdserve/models/SmolLM2-135M-Instruct.Q4_1.gguf,Q8_0,BF16

For each deployment (the PD cluster: router + prefill + decode; one colocated worker) it runs
bench/serving.py's load (exact 128-token prompts, 128 output tokens, ignore_eos) at each
concurrency, one deployment at a time so they never share the 2 cores; then `transformers`
``generate`` on the same weights with batches of the same size. It prints throughput and TTFT
with ratios, and the vLLM CPU anchor figures from issue 4 for reference (measured there, not here).
With ``--vllm-python`` (an environment where vLLM is installed, see bench/vllm_ref.py) vLLM
serves the same checkpoint and load in the same run, and every row gets its ratio to it: the
fair comparison on a shared machine whose speed drifts with its neighbours' load.
With ``--llamacpp`` llama.cpp's ``llama-server`` (bench/llamacpp_ref.py, built once) serves each
listed GGUF under the same load: a path, or BF16 / Q8_0 / Q4_K_M ... for llama.cpp's own
conversion of the checkpoint pdserve serves; pdserve's deployments serve each file too (``pd-Q4_1``,
``colocated-Q4_1``, ...; ``--no-same-file``: only its own checkpoint). Config ``smollm2`` is
SmolLM2-135M-Instruct (bench/real_model.py): pdserve's own checkpoint is then the bf16 HF
directory made from the shipped Q4_1 GGUF. Deployment ``pd_secure`` is the PD cluster with its
control plane locked (an API key on every process, TLS on every listener with a CA made for the
run, the router calling its workers and the decode the prefill's bootstrap port over HTTPS), run
right after ``pd`` under the same load; the report gives its throughput over ``pd``'s, same run
(goal: at least 0.95).
directory made from the shipped Q4_1 GGUF.
With ``--features off,on`` pdserve's deployments run once per variant in the same run
(``pd:off``, ``pd:on``, ...): ``off`` turns SSE keep-alive off and schedules fcfs, ``on`` sends
keep-alives every ``--keepalive-s`` and schedules by priority, and each on / off throughput
ratio is printed (issue 32's goal: within 3% at c8 on ``small``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llamacpp_ref, real_model  # noqa: E402
from bench.cluster import Cluster, ClusterSpec, ManagedProc, free_port  # noqa: E402
from bench.serving import BenchConfig, run_benchmark  # noqa: E402
from bench.vllm_ref import VllmServer  # noqa: E402
from pdserve.cli_common import run_async  # noqa: E402
from pdserve.model.demo import DemoShape, ensure_demo_model, write_demo_model  # noqa: E402

# Issue 3's reference shapes (Llama, bf16, head_dim 64); the vocabulary comes from the tokenizer
# trained for the checkpoint (close to 32000).
SHAPES = {
    "tiny": DemoShape(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                      intermediate_size=512, target_vocab_size=32000, max_corpus_bytes=6_000_000),
    "small": DemoShape(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
                       intermediate_size=2816, target_vocab_size=32000,
                       max_corpus_bytes=6_000_000),
}  # fmt: skip
# vLLM 0.32 CPU build, tuned, colocated, 128 in / 128 out, on these machines (issue 4).
VLLM_ANCHOR_TOK_S = {("tiny", 1): "240-310", ("tiny", 8): "980-1220",
                     ("small", 1): "41-50", ("small", 8): "224-233"}  # fmt: skip
LLAMACPP_PREFIX = "llamacpp-"  # + the GGUF's weight type: one deployment per file
PERF_ARGS = ("--kv-cache-mb", "256", "--heartbeat-interval", "1.0")
FEATURES = ("off", "on")  # --features: SSE keep-alive and priority scheduling off / on


def feature_args(variant: str | None, keepalive_s: float) -> tuple[tuple[str, ...], ...]:
    """(worker flags, router flags) of a --features variant; None: the servers' defaults."""
    if variant is None:
        return (), ()
    period = "0" if variant == "off" else f"{keepalive_s:g}"
    policy = "fcfs" if variant == "off" else "priority"
    keepalive = ("--sse-keepalive-s", period)
    return (*keepalive, "--scheduling-policy", policy), keepalive


def checkpoint(name: str, root: Path, model_dir: str | None = None) -> Path:
    if model_dir:  # a checkpoint written earlier (saves the tokenizer training of each run)
        return Path(model_dir)
    if name == "demo":
        return ensure_demo_model()
    if name == "smollm2":
        return real_model.ensure_hf_dir(real_model.ensure_gguf())
    return write_demo_model(root / name, SHAPES[name])


def _role_args(threads: int | None) -> tuple[str, ...]:
    return ("--num-threads", str(threads)) if threads else ()


def shared_lease_args() -> tuple[str, ...]:
    """Worker flags of one fresh CPU lease: as `pdserve up` runs them, workers that share this
    machine's cores take turns at them (pdserve/engine/cpu_lease.py)."""
    return ("--cpu-lease", str(Path(tempfile.mkdtemp(prefix="pdserve-bench-")) / "lease"))


SECURE_GOAL = 0.95  # pd_secure's throughput over pd's, same run


async def serve_load(
    url: str,
    tokenizer: Path,
    args: argparse.Namespace,
    conc: int,
    is_closing: bool = False,
    secure: ClusterSpec | None = None,
) -> dict:
    cfg = BenchConfig(
        base_url=url, model="bench", endpoint="completions", input_len=args.input_len,
        output_len=args.output_len, num_requests=max(args.num_requests, conc), concurrency=conc,
        tokenizer=str(tokenizer), is_progress_shown=False, num_warmup=2,
        is_connection_closed=is_closing,
        api_key=secure.api_key if secure else None,
        ca_certs=str(secure.tls.ca) if secure and secure.tls else None,
    )  # fmt: skip
    return await run_benchmark(cfg)


async def bench_pd(
    model_dir: Path, args: argparse.Namespace, model: Path | None = None,
    variant: str | None = None, is_secure: bool = False,
) -> dict[int, dict]:  # fmt: skip
    """The PD cluster on ``model`` (default: ``model_dir``; a GGUF file of the same
    checkpoint, say), loaded with ``model_dir``'s tokenizer; ``variant``: of --features;
    ``is_secure``: with an API key and TLS everywhere (deployment pd_secure)."""
    workers, router = feature_args(variant, args.keepalive_s)
    spec = ClusterSpec(model_dir=str(model or model_dir), served_model_name="bench",
                       worker_args=PERF_ARGS + workers, router_args=router)  # fmt: skip
    if is_secure:
        from bench.tls_certs import make_certs

        certs = make_certs(Path(tempfile.mkdtemp(prefix="pdserve-bench-tls-")))
        spec = replace(spec, tls=certs, api_key=secrets.token_urlsafe(24))
    cluster = Cluster(spec)
    lease_args = shared_lease_args() if args.cpu_lease else ()
    for proc in cluster.prefills:
        proc.extra_args = _role_args(args.prefill_threads) + lease_args
    for proc in cluster.decodes:
        proc.extra_args = _role_args(args.decode_threads) + lease_args
    secure = spec if is_secure else None
    async with cluster:
        url = cluster.router.url
        return {c: await serve_load(url, model_dir, args, c, secure=secure) for c in args.conc}


async def bench_colocated(
    model_dir: Path, args: argparse.Namespace, model: Path | None = None,
    variant: str | None = None,
) -> dict[int, dict]:  # fmt: skip
    """One colocated worker on ``model`` (as bench_pd)."""
    port = free_port()
    workers, _ = feature_args(variant, args.keepalive_s)
    log = Path(tempfile.mkdtemp(prefix="pdserve-bench-")) / "colocated.log"
    proc = ManagedProc("colocated", "colocated",
                       ["serve", "--role", "colocated", "--model", str(model or model_dir),
                        "--port",
                        str(port), "--served-model-name", "bench", *PERF_ARGS, *workers,
                        *_role_args(args.colocated_threads)],
                       f"http://127.0.0.1:{port}", log)  # fmt: skip
    async with aiohttp.ClientSession() as session:
        proc.start()
        try:
            await proc.wait_ready(session, ClusterSpec(model_dir="").max_ready_s)
            return {c: await serve_load(proc.url, model_dir, args, c) for c in args.conc}
        finally:
            await asyncio.to_thread(proc.stop)


async def bench_vllm(model_dir: Path, args: argparse.Namespace) -> dict[int, dict]:
    server = VllmServer(args.vllm_python, model_dir, free_port())
    print(f"vLLM: starting ({server.log_path})", flush=True)
    async with server:
        return {c: await serve_load(server.url, model_dir, args, c) for c in args.conc}


def llamacpp_ggufs(spec: str, model_dir: Path, tree: llamacpp_ref.LlamaCppTree) -> list[Path]:
    """``--llamacpp``'s comma list as files: paths as given; a type of llamacpp_ref.FILE_TYPES
    (BF16, Q8_0, Q4_K_M, ...) converted from the checkpoint pdserve serves (cached beside it)."""
    out = []
    for item in filter(None, spec.split(",")):
        is_type = item.upper() in llamacpp_ref.FILE_TYPES
        out.append(
            llamacpp_ref.write_gguf(tree, model_dir, item.upper()) if is_type else Path(item)
        )
    return out


async def bench_llamacpp(
    tree: llamacpp_ref.LlamaCppTree, gguf: Path, model_dir: Path, args: argparse.Namespace
) -> dict[int, dict]:
    """llama-server on ``gguf``; the client tokenizes with ``model_dir``'s tokenizer, as for
    pdserve, so both get the same prompts."""
    server = llamacpp_ref.LlamaServer(tree.server, gguf, free_port(),
                                      num_threads=args.llamacpp_threads)  # fmt: skip
    print(f"llama.cpp: serving {gguf} ({server.log_path})", flush=True)
    async with server:
        # One connection per request (llama-server drops reused ones; see BenchConfig).
        return {c: await serve_load(server.url, model_dir, args, c, True) for c in args.conc}


def bench_transformers(model_dir: Path, args: argparse.Namespace) -> dict[int, dict]:
    """`model.generate` on batches of `concurrency` prompts: the plain-loop baseline."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    vocab = model.config.vocab_size
    out: dict[int, dict] = {}
    for conc in args.conc:
        ids = torch.randint(
            3, vocab, (conc, args.input_len), generator=torch.Generator().manual_seed(0)
        )
        kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(
                ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len, **kw
            )
            total = time.perf_counter() - t0
        out[conc] = {"output_throughput": conc * args.output_len / total,
                     "ttft_ms": {"p50": ttft * 1000},
                     "tpot_ms": {"p50": (total - ttft) / (args.output_len - 1) * 1000}}  # fmt: skip
    return out


def summary_metric(summary: dict | None, *path: str) -> float | None:
    """The float at ``path`` in a benchmark summary, or None where any key is missing."""
    value: Any = summary
    for key in path:
        if not isinstance(value, dict) or value.get(key) is None:
            return None
        value = value[key]
    return float(value)


def deployment_order(results: dict[str, dict[int, dict]]) -> list[str]:
    """pdserve's deployments, then the references (vLLM, transformers), then each GGUF file's
    pdserve deployments beside llama.cpp's."""
    per_file = [d for d in results if "-" in d]
    variants = [d for d in results if ":" in d]  # --features: pd:off, pd:on, ...
    fixed = [d for d in ("pd", "pd_secure", "colocated", "vllm", "transformers") if d in results]
    return fixed + variants + per_file


def report(name: str, results: dict[str, dict[int, dict]], conc: list[int]) -> list[dict]:
    rows = []
    print(f"\n== {name}: {conc} concurrency, tok/s = output tokens per second ==")
    print(f"{'deployment':<16}{'conc':>5}{'tok/s':>10}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}"
          f"{'failed':>8}{'x colocated':>13}{'x transformers':>16}{'x vLLM':>8}"
          f"{'vLLM anchor':>13}")  # fmt: skip
    for c in conc:
        base = summary_metric(results.get("colocated", {}).get(c, {}), "output_throughput")
        hf = summary_metric(results.get("transformers", {}).get(c, {}), "output_throughput")
        ref = summary_metric(results.get("vllm", {}).get(c, {}), "output_throughput")
        for dep in deployment_order(results):
            s = results[dep][c]
            tps = summary_metric(s, "output_throughput") or 0.0
            row = {"config": name, "deployment": dep, "concurrency": c, "tok_s": tps,
                   "ttft_p50_ms": summary_metric(s, "ttft_ms", "p50"),
                   "tpot_p50_ms": summary_metric(s, "tpot_ms", "p50"),
                   "x_colocated": tps / base if base else None,
                   "x_transformers": tps / hf if hf else None,
                   "x_vllm": tps / ref if ref else None,
                   "errors": s.get("num_errors", 0),
                   "num_requests": s.get("num_requests", 0)}  # fmt: skip
            rows.append(row)
            print(f"{dep:<16}{c:>5}{tps:>10.1f}{row['ttft_p50_ms'] or 0:>13.1f}"
                  f"{row['tpot_p50_ms'] or 0:>13.2f}{row['errors']:>8}"
                  f"{row['x_colocated'] or 0:>13.2f}"
                  f"{row['x_transformers'] or 0:>16.2f}{row['x_vllm'] or 0:>8.2f}"
                  f"{VLLM_ANCHOR_TOK_S.get((name, c), '-'):>13}")  # fmt: skip
    return rows


async def run_all(args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-ckpt-") as tmp:
        for name in args.configs:
            model_dir = checkpoint(name, Path(tmp), args.model_dir)
            results: dict[str, dict[int, dict]] = {}
            for variant in args.feature_variants or [None]:  # one after the other, same run
                suffix = "" if variant is None else f":{variant}"
                if "pd" in args.deps:
                    results["pd" + suffix] = await bench_pd(model_dir, args, variant=variant)
                if "pd_secure" in args.deps and variant is None:
                    results["pd_secure"] = await bench_pd(model_dir, args, is_secure=True)
                if "colocated" in args.deps:
                    results["colocated" + suffix] = await bench_colocated(
                        model_dir, args, variant=variant
                    )
            if args.vllm_python:
                results["vllm"] = await bench_vllm(model_dir, args)
            if args.llamacpp:
                tree = await asyncio.to_thread(llamacpp_ref.ensure_build)
                ggufs = await asyncio.to_thread(llamacpp_ggufs, args.llamacpp, model_dir, tree)
                for gguf in ggufs:
                    label = llamacpp_ref.gguf_label(gguf)
                    if args.same_file:  # pdserve on the very file llama.cpp serves
                        for dep, bench in (("pd", bench_pd), ("colocated", bench_colocated)):
                            if dep in args.deps:
                                results[f"{dep}-{label}"] = await bench(model_dir, args, gguf)
                    results[LLAMACPP_PREFIX + label] = await bench_llamacpp(
                        tree, gguf, model_dir, args
                    )
            if "transformers" in args.deps:
                results["transformers"] = await asyncio.to_thread(
                    bench_transformers, model_dir, args
                )
            rows += report(name, results, args.conc)
    return rows


def ratio_lines(rows: list[dict], prefix: str) -> list[str]:
    """pdserve's throughput over each reference deployment's (``prefix`` + label), per
    concurrency: pdserve on its own checkpoint and, where it ran, on the reference's file."""
    by_key = {(r["config"], r["deployment"], r["concurrency"]): r for r in rows}
    lines = []
    for config, ref, conc in sorted(k for k in by_key if k[1].startswith(prefix)):
        label, theirs = ref[len(prefix) :], by_key[(config, ref, conc)]
        for dep in ("pd", "colocated", f"pd-{label}", f"colocated-{label}"):
            mine = by_key.get((config, dep, conc))
            if mine is None or not theirs["tok_s"]:
                continue
            line = (f"{config} c{conc}: {dep} / {ref} throughput, same run: "
                    f"{mine['tok_s'] / theirs['tok_s']:.2f}")  # fmt: skip
            if mine.get("tpot_p50_ms") and theirs.get("tpot_p50_ms"):
                line += f"; TPOT p50 {mine['tpot_p50_ms']:.1f} vs {theirs['tpot_p50_ms']:.1f} ms"
            lines.append(line)
    return lines


def secure_lines(rows: list[dict]) -> list[str]:
    """pd_secure's throughput over pd's per config and concurrency (both in this run)."""
    by_key = {(r["config"], r["deployment"], r["concurrency"]): r for r in rows}
    lines = []
    for config, dep, conc in sorted(k for k in by_key if k[1] == "pd_secure"):
        plain = by_key.get((config, "pd", conc))
        if plain and plain["tok_s"]:
            ratio = by_key[(config, dep, conc)]["tok_s"] / plain["tok_s"]
            verdict = "within" if ratio >= SECURE_GOAL else "NOT within"
            lines.append(f"{config} c{conc}: pd_secure (API key + TLS) / pd throughput, same run: "
                         f"{ratio:.3f} ({verdict} {1 - SECURE_GOAL:.0%} of off)")  # fmt: skip
    return lines


def feature_lines(rows: list[dict]) -> list[str]:
    """--features: each deployment's on / off throughput and TTFT, per concurrency."""
    by_key = {(r["config"], r["deployment"], r["concurrency"]): r for r in rows}
    lines = []
    for config, dep, conc in sorted(k for k in by_key if k[1].endswith(":on")):
        on, off = by_key[(config, dep, conc)], by_key.get((config, dep[:-3] + ":off", conc))
        if off is None or not off["tok_s"]:
            continue
        lines.append(
            f"{config} c{conc}: {dep[:-3]} keep-alive+priority on / off throughput, same run: "
            f"{on['tok_s'] / off['tok_s']:.3f}; TTFT p50 {on['ttft_p50_ms'] or 0:.1f} vs "
            f"{off['ttft_p50_ms'] or 0:.1f} ms"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--config", default="tiny,small", help="comma list of tiny, small, demo, smollm2"
    )
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json-out", default=None)
    p.add_argument("--model-dir", default=None, help="reuse this checkpoint (one --config)")
    p.add_argument(
        "--deployments", default="pd,colocated,transformers",
        help="comma list of pd, pd_secure (API key + TLS everywhere), colocated, transformers",
    )  # fmt: skip
    p.add_argument(
        "--prefill-threads", type=int, default=None,
        help="torch threads, PD prefill (default: all cores, as pdserve up)",
    )  # fmt: skip
    p.add_argument(
        "--cpu-lease", action=argparse.BooleanOptionalAction, default=True,
        help="PD workers take turns at the cores (as pdserve up)",
    )  # fmt: skip
    p.add_argument("--decode-threads", type=int, default=None, help="torch threads, PD decode")
    p.add_argument("--colocated-threads", type=int, default=None)
    p.add_argument(
        "--vllm-python", default=None,
        help="python of an environment with vLLM: serve the same load with it too",
    )  # fmt: skip
    p.add_argument(
        "--llamacpp", default=None, metavar="GGUF[,GGUF...]",
        help="llama-server on each GGUF too: a path, or BF16, Q8_0, Q4_K_M, ... made from the "
        "checkpoint",
    )  # fmt: skip
    p.add_argument("--llamacpp-threads", type=int, default=2, help="llama-server -t")
    p.add_argument(
        "--same-file", action=argparse.BooleanOptionalAction, default=True,
        help="with --llamacpp: pdserve's deployments serve each GGUF file too",
    )  # fmt: skip
    p.add_argument(
        "--features", default="", metavar="off,on",
        help="run pdserve's deployments once per variant: off (no SSE keep-alive, fcfs) and/or "
        "on (keep-alive every --keepalive-s, priority scheduling); default: the servers' own",
    )  # fmt: skip
    p.add_argument("--keepalive-s", type=float, default=15.0, help="--features on's period")
    args = p.parse_args(argv)
    args.feature_variants = [v for v in args.features.split(",") if v]
    if not set(args.feature_variants) <= set(FEATURES):
        p.error(f"--features takes a comma list of {', '.join(FEATURES)}")
    args.deps = args.deployments.split(",")
    args.configs = args.config.split(",")
    args.conc = [int(c) for c in args.concurrency.split(",")]
    rows = run_async(run_all(args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))
    # Exit status: pdserve's (and vLLM's) failures; llama.cpp's are reported, as the issue's
    # table does ("1 of 32": llama-server drops a connection now and then).
    is_llama = [r["deployment"].startswith(LLAMACPP_PREFIX) for r in rows]
    errors = sum(r["errors"] or 0 for r, skip in zip(rows, is_llama, strict=True) if not skip)
    for dep in sorted({r["deployment"] for r, keep in zip(rows, is_llama, strict=True) if keep}):
        failed = sum(r["errors"] or 0 for r in rows if r["deployment"] == dep)
        total = sum(r["num_requests"] for r in rows if r["deployment"] == dep)
        print(f"{dep}: {failed} of {total} requests failed")
    pd_ratio = statistics.median(
        [r["x_colocated"] or 0 for r in rows if r["deployment"] == "pd"] or [0.0]
    )
    print(f"\nrequests that failed: {errors}; median PD/colocated throughput: {pd_ratio:.2f}")
    for dep in ("pd", "colocated"):
        vs = [r["x_vllm"] for r in rows if r["deployment"] == dep and r["x_vllm"]]
        if vs:
            print(f"{dep} / vLLM throughput, same run: " + ", ".join(f"{v:.2f}" for v in vs))
    for line in ratio_lines(rows, LLAMACPP_PREFIX) + secure_lines(rows) + feature_lines(rows):
        print(line)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
