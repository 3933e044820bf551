"""Tool calling on 20 prompts (8 single calls, 6 two parallel calls, 6 needing no call; the five
tool schemas of bench/data/tool_prompts.json), against pdserve or llama.cpp's llama-server.

Each prompt is asked twice with the official openai client, greedy: streamed (assembled by
call index, as clients do) and not. Reported, per target: the calls parsed, those whose
arguments validate against their tool's schema (jsonschema), the prompts answered as their kind
asks (the expected number of valid calls; no call for the "none" kind), and how many prompts
streamed exactly what the unstreamed answer holds (content, call names, arguments as JSON).

    M=~/.cache/pdserve/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
    python bench/tool_calls.py --target pdserve --model $M
    python bench/tool_calls.py --target llamacpp --model $M     # llama-server --jinja
    python bench/tool_calls.py --url http://127.0.0.1:8000 --served-model-name NAME

Not a timing benchmark: the figures are counts, so a loaded machine only makes it slower.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from anywhere

from bench.cluster import ManagedProc, free_port  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "tool_prompts.json"
READY_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 600.0


def load_prompts() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    data = json.loads(DATA.read_text())
    return data["tools"], data["prompts"]


def _shape(message: Any) -> tuple[str | None, list[tuple[str, Any]]]:
    """What is compared between streamed and not: content and calls with parsed arguments."""
    calls = []
    for call in message.tool_calls or []:
        calls.append((call.function.name, _json_or_text(call.function.arguments)))
    return message.content or None, calls


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # compared as text when it is not JSON


async def _streamed_shape(stream: Any) -> tuple[str | None, list[tuple[str, Any]]]:
    """A stream assembled as clients do (by call ``index``); also when it ends at ``length``,
    where the openai client's ``stream()`` helper raises instead."""
    content: list[str] = []
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for piece in choice.delta.tool_calls or []:
                if piece.function and piece.function.name:
                    names[piece.index] = piece.function.name
                if piece.function and piece.function.arguments:
                    args.setdefault(piece.index, []).append(piece.function.arguments)
    calls = [(names[i], _json_or_text("".join(args.get(i, [])))) for i in sorted(names)]
    return "".join(content) or None, calls


def score_calls(calls: list[tuple[str, Any]], schemas: dict[str, dict[str, Any]]) -> int:
    """How many of ``calls`` name a tool and carry arguments valid under its schema."""
    valid = 0
    for name, args in calls:
        if name in schemas and isinstance(args, dict):
            try:
                jsonschema.validate(args, schemas[name])
            except jsonschema.ValidationError:
                continue
            valid += 1
    return valid


async def ask(
    client: AsyncOpenAI, model: str, tools: list[dict[str, Any]], prompt: str, max_tokens: int
) -> tuple[Any, Any]:
    """(unstreamed message, streamed (content, calls)) for one prompt."""
    request: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "tools": tools,
        # Said outright: llama-server's default is false (OpenAI's and pdserve's, true).
        "parallel_tool_calls": True,
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    whole = await client.chat.completions.create(**request)
    streamed = await _streamed_shape(await client.chat.completions.create(**request, stream=True))
    return whole.choices[0].message, streamed


async def run_prompts(
    url: str, model: str, max_tokens: int, limit: int | None = None
) -> dict[str, Any]:
    tools, prompts = load_prompts()
    prompts = prompts[:limit] if limit else prompts
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    rows = []
    # Retries: llama-server may close a kept-alive connection between two requests, which the
    # client sees as "Server disconnected without sending a response" before the request ran.
    async with AsyncOpenAI(
        base_url=f"{url}/v1", api_key="x", max_retries=2, timeout=REQUEST_TIMEOUT_S
    ) as client:
        for item in prompts:
            whole, streamed = await ask(client, model, tools, item["prompt"], max_tokens)
            content, calls = _shape(whole)
            valid = score_calls(calls, schemas)
            rows.append({
                "kind": item["kind"],
                "prompt": item["prompt"],
                "num_calls": len(calls),
                "num_valid_calls": valid,
                "is_as_asked": valid == item["num_calls"] == len(calls),
                "is_stream_equal": streamed == (content, calls),
                "calls": calls,
                "content": content,
            })  # fmt: skip
    return summarize(rows)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def count(key: str, kind: str | None = None) -> int:
        return sum(int(r[key]) for r in rows if kind is None or r["kind"] == kind)

    return {
        "num_prompts": len(rows),
        "num_calls": count("num_calls"),
        "num_valid_calls": count("num_valid_calls"),
        "num_as_asked": count("is_as_asked"),
        "as_asked_by_kind": {k: count("is_as_asked", k) for k in ("single", "parallel", "none")},
        "num_stream_equal": count("is_stream_equal"),
        "rows": rows,
    }


def pdserve_proc(model: Path, port: int, log: Path, threads: int, parser: str) -> ManagedProc:
    argv = ["serve", "--role", "colocated", "--model", str(model), "--port", str(port),
            "--served-model-name", "bench", "--num-threads", str(threads),
            "--tool-call-parser", parser]  # fmt: skip
    return ManagedProc("pdserve", "colocated", argv, f"http://127.0.0.1:{port}", log)


def llamacpp_proc(model: Path, port: int, log: Path, threads: int) -> ManagedProc:
    from bench.llamacpp_ref import LlamaServer, ensure_build

    server = LlamaServer(ensure_build().server, model, port, num_threads=threads, jinja=True,
                         served_model_name="bench", log_path=log)  # fmt: skip
    return server.proc


async def run_target(args: argparse.Namespace) -> dict[str, Any]:
    if args.url:
        return await run_prompts(args.url, args.served_model_name, args.max_tokens, args.limit)
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="pdserve-tool-bench-")) / f"{args.target}.log"
    model = Path(args.model)
    if args.target == "pdserve":
        proc = pdserve_proc(model, port, log, args.threads, args.tool_call_parser)
    else:
        proc = llamacpp_proc(model, port, log, args.threads)
    await asyncio.to_thread(proc.start)
    try:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            await proc.wait_ready(session, READY_TIMEOUT_S)
        result = await run_prompts(proc.url, "bench", args.max_tokens, args.limit)
    finally:
        await asyncio.to_thread(proc.stop)
    return {"target": args.target, "model": str(model), **result}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", choices=["pdserve", "llamacpp"], default="pdserve")
    p.add_argument("--model", help="the GGUF file (both targets serve the same one)")
    p.add_argument("--url", help="an already running server instead of starting one")
    p.add_argument("--served-model-name", default="bench", help="with --url: its model name")
    p.add_argument("--tool-call-parser", default="auto", help="pdserve's --tool-call-parser")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts (smoke)")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    args = p.parse_args(argv)
    args.model = args.model and str(Path(args.model).expanduser())
    if not args.url and not args.model:
        p.error("give --model (to start a server) or --url")
    result = asyncio.run(run_target(args))
    if args.json:
        print(json.dumps(result, indent=1, ensure_ascii=False))
    else:
        n = result["num_prompts"]
        print(
            f"calls parsed {result['num_calls']}, with valid arguments {result['num_valid_calls']}"
        )
        print(
            f"prompts answered as asked {result['num_as_asked']}/{n} {result['as_asked_by_kind']}"
        )
        print(f"streaming == non-streaming {result['num_stream_equal']}/{n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
