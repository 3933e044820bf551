"""One real client's standard flow against an OpenAI-compatible URL; run by bench/clients.py
inside its own venv (the clients are not pdserve dependencies). Prints one JSON line:
``{"ok": bool, "detail": str, ...numbers}``.

    python bench/client_flows.py FLOW --base-url http://127.0.0.1:PORT/v1 --model demo \
        --model-dir DIR --work-dir DIR

FLOW: guidellm, aiperf, instructor, langchain, agents, lm_eval.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

NUM_SEEDS = 20  # instructor: tries per mode
TIMEOUT_S = 900  # one CLI benchmark


def _run(argv: list[str], log: Path) -> int:
    with open(log, "w") as out:
        return subprocess.run(
            argv, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S
        ).returncode


def _bin(name: str) -> str:
    return os.path.join(os.path.dirname(sys.executable), name)


def _guidellm_run(a: argparse.Namespace, request_format: str, num: int) -> dict[str, Any]:
    work = Path(a.work_dir)
    tag = request_format.strip("/").replace("/", "_")
    out, scenario = work / f"guidellm-{tag}.json", work / f"guidellm-{tag}-scenario.json"
    spec = {
        "backend": {"kind": "openai_http", "target": a.base_url.removesuffix("/v1"),
                    "model": a.model, "request_format": request_format},
        "profile": {"kind": "concurrent", "streams": [4]},
        "constraints": [{"kind": "max_requests", "count": num}],
        "tokenizer": {"kind": "huggingface_auto", "model": a.model_dir},
        "data": [{"kind": "synthetic_text", "prompt_tokens": 128, "output_tokens": 64}],
        "outputs": [{"kind": "json", "path": str(out)}],
    }  # fmt: skip
    scenario.write_text(json.dumps({"metadata": {"name": "pdserve-clients"}, "spec": spec}))
    argv = [_bin("guidellm"), "run", "--scenario", str(scenario), "--disable-console-interactive"]
    rc = _run(argv, work / f"guidellm-{tag}.log")
    if rc != 0 or not out.is_file():
        return {"ok": False, "detail": f"guidellm exited {rc} (see guidellm-{tag}.log)"}
    return _guidellm_summary(json.loads(out.read_text()), num)


def _guidellm_summary(report: dict[str, Any], num: int) -> dict[str, Any]:
    bench = report["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    ttft = bench["metrics"]["time_to_first_token_ms"]["successful"]["median"]
    errors = totals.get("errored", 0) + totals.get("incomplete", 0)
    ok = errors == 0 and totals.get("successful", 0) == num and ttft is not None and ttft > 0
    detail = f"{totals.get('successful')} ok, {errors} errors, TTFT median {ttft:.0f} ms"
    return {"ok": ok, "detail": detail, "errors": errors, "ttft_ms": ttft}


def guidellm(a: argparse.Namespace) -> dict[str, Any]:
    """Streaming (guidellm's default), concurrency 4, 128 in / 64 out: 32 chat requests, then
    4 completions (guidellm sends stream_options.continuous_usage_stats on both)."""
    chat = _guidellm_run(a, "/v1/chat/completions", 32)
    text = _guidellm_run(a, "/v1/completions", 4)
    ok = chat["ok"] and text["ok"]
    return {"ok": ok, "detail": f"chat: {chat['detail']}; completions: {text['detail']}",
            "ttft_ms": chat.get("ttft_ms")}  # fmt: skip


def aiperf(a: argparse.Namespace) -> dict[str, Any]:
    """32 requests, concurrency 4, 128 in / 64 out, streaming chat."""
    art = Path(a.work_dir) / "aiperf"
    argv = [_bin("aiperf"), "profile", "--model", a.model, "--url", a.base_url.removesuffix("/v1"),
            "--endpoint-type", "chat", "--streaming", "--concurrency", "4",
            "--request-count", "32", "--synthetic-input-tokens-mean", "128",
            "--prompt-input-tokens-stddev", "0", "--output-tokens-mean", "64",
            "--output-tokens-stddev", "0", "--tokenizer", a.model_dir,
            "--artifact-dir", str(art), "--ui-type", "none"]  # fmt: skip
    rc = _run(argv, Path(a.work_dir) / "aiperf.log")
    found = glob.glob(str(art / "**" / "profile_export_aiperf.json"), recursive=True)
    if rc != 0 or not found:
        return {"ok": False, "detail": f"aiperf exited {rc} (see aiperf.log)"}
    report = json.loads(Path(found[0]).read_text())
    ttft = (_find(report, "time_to_first_token") or {}).get("avg")
    count = (_find(report, "request_count") or {}).get("avg")
    errors = (_find(report, "error_request_count") or {}).get("avg", 0) or 0
    ok = errors == 0 and count == 32 and ttft is not None
    return {"ok": ok, "detail": f"{count} ok, {errors} errors, TTFT mean {ttft} ms",
            "errors": errors, "ttft_ms": ttft}  # fmt: skip


def _find(obj: Any, key: str) -> Any:
    """The first value named ``key`` anywhere in a JSON report (its nesting varies by version)."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for item in obj:
            found = _find(item, key)
            if found is not None:
                return found
    return None


def _pydantic_model() -> Any:
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        """A person named in the text."""

        name: str = Field(description="the person's name", max_length=12)
        age: int = Field(description="age in years", ge=0, le=120)

    return Person


def instructor(a: argparse.Namespace) -> dict[str, Any]:
    """JSON_SCHEMA and TOOLS: how many of NUM_SEEDS tries return a validated object."""
    import instructor as ins
    import openai

    person = _pydantic_model()
    raw = openai.OpenAI(base_url=a.base_url, api_key="x", max_retries=0, timeout=120)
    counts = {}
    for mode in (ins.Mode.JSON_SCHEMA, ins.Mode.TOOLS):
        client = ins.from_openai(raw, mode=mode)
        num_ok = 0
        for seed in range(NUM_SEEDS):
            try:
                client.chat.completions.create(
                    model=a.model, response_model=person, max_retries=0, seed=seed,
                    max_tokens=48, temperature=0.7,
                    messages=[{"role": "user", "content": "Alice is 31. Who is she?"}],
                )  # fmt: skip
                num_ok += 1
            except Exception as exc:  # a validation failure: counted, and the next seed tried
                print(f"instructor {mode.name} seed {seed}: {exc!r}"[:300], file=sys.stderr)
        counts[mode.name] = num_ok
    need = NUM_SEEDS - 1 if a.is_demo else NUM_SEEDS
    ok = all(n >= need for n in counts.values())
    detail = ", ".join(f"{k} {v}/{NUM_SEEDS}" for k, v in counts.items())
    return {"ok": ok, "detail": detail, **counts}


def langchain(a: argparse.Namespace) -> dict[str, Any]:
    """with_structured_output (json_schema, function_calling), bind_tools, stream and batch."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class AddArgs(BaseModel):
        # Bounded: a random-weight model given an unbounded integer writes digits to max_tokens.
        x: int = Field(ge=0, le=99)
        y: int = Field(ge=0, le=99)

    @tool(args_schema=AddArgs)
    def add(x: int, y: int) -> int:
        """Add two integers."""
        return x + y

    llm = ChatOpenAI(base_url=a.base_url, api_key="x", model=a.model, max_tokens=48,
                     temperature=0, max_retries=0, timeout=120)  # fmt: skip
    person = _pydantic_model()
    results = {}
    for method in ("json_schema", "function_calling"):
        try:
            out = llm.with_structured_output(person, method=method).invoke("Alice is 31.")
            results[method] = isinstance(out, person)
        except Exception as exc:
            print(f"langchain {method}: {exc!r}"[:300], file=sys.stderr)
            results[method] = False
    msg = llm.bind_tools([add], tool_choice="add").invoke("What is 2 plus 3?")
    results["bind_tools"] = bool(msg.tool_calls) and msg.tool_calls[0]["name"] == "add"
    if not results["bind_tools"]:
        print(f"langchain bind_tools: {msg!r}"[:600], file=sys.stderr)
    results["stream"] = len(list(llm.stream("Hi"))) > 1
    results["batch"] = len(llm.batch(["Hi", "Hello"])) == 2
    return {"ok": all(results.values()), "detail": ", ".join(
        f"{k} {'ok' if v else 'FAIL'}" for k, v in results.items())}  # fmt: skip


def agents(a: argparse.Namespace) -> dict[str, Any]:
    """openai-agents: one tool turn over chat completions (the tool is forced once)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    # A closed set of cities: a random-weight model given a free string may write it to
    # max_tokens, and the truncated arguments fail the tool (a real model names the city).
    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    model = OpenAIChatCompletionsModel(
        model=a.model, openai_client=AsyncOpenAI(base_url=a.base_url, api_key="x", max_retries=0)
    )
    agent = Agent(
        name="weather", instructions="Answer with the tool.", model=model, tools=[get_weather],
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=48),
        tool_use_behavior="stop_on_first_tool",
    )  # fmt: skip
    result = asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=2))
    ok = len(calls) == 1 and result.final_output == "sunny"
    return {"ok": ok, "detail": f"{len(calls)} tool call(s), final {result.final_output!r}"}


_MC_TASK = """task: pdserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
_GEN_TASK = """task: pdserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""
_QUESTIONS = [
    ("The sky is", [" blue", " green", " loud"], 0),
    ("Two plus two is", [" four", " five", " seven"], 0),
    ("Water is", [" wet", " dry", " square"], 0),
    ("A cat says", [" meow", " moo", " quack"], 0),
    ("Fire is", [" hot", " cold", " blue"], 0),
    ("The sun rises in the", [" east", " west", " sea"], 0),
    ("Ice is", [" cold", " warm", " red"], 0),
    ("Birds can", [" fly", " read", " swim"], 0),
    ("Snow is", [" white", " black", " green"], 0),
    ("A dog says", [" woof", " meow", " baa"], 0),
]


def _write_tasks(work: Path) -> Path:
    tasks = work / "lm_eval_tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    mc, gen = tasks / "mc.jsonl", tasks / "gen.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": t}) + "\n"
                          for q, c, t in _QUESTIONS))  # fmt: skip
    gen.write_text("".join(json.dumps({"question": q, "answer": c[t]}) + "\n"
                           for q, c, t in _QUESTIONS))  # fmt: skip
    (tasks / "pdserve_mc.yaml").write_text(_MC_TASK.format(data=mc))
    (tasks / "pdserve_gen.yaml").write_text(_GEN_TASK.format(data=gen))
    return tasks


def _lm_eval_samples(model: str, model_args: str, tasks: Path) -> dict[str, list[Any]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=["pdserve_mc", "pdserve_gen"],
        task_manager=TaskManager(include_path=str(tasks)), log_samples=True, batch_size=1,
    )  # fmt: skip
    samples = {}
    for task, items in out["samples"].items():
        items = sorted(items, key=lambda s: s["doc_id"])
        samples[task] = [s["filtered_resps"] for s in items]
    return samples


def lm_eval(a: argparse.Namespace) -> dict[str, Any]:
    """local-completions (loglikelihood and generate_until) item by item against the ``hf``
    backend in float32; the per-item numbers go to the work dir for the cross-target check."""
    work = Path(a.work_dir)
    tasks = _write_tasks(work)
    cache = work / "lm_eval_hf.json"  # the reference does not depend on the target
    if cache.is_file():
        ref = json.loads(cache.read_text())
    else:
        ref = _lm_eval_samples("hf", f"pretrained={a.model_dir},dtype=float32,device=cpu", tasks)
        cache.write_text(json.dumps(ref))
    args = (
        f"model={a.model},base_url={a.base_url}/completions,tokenizer={a.model_dir},"
        "tokenizer_backend=huggingface,add_bos_token=True,num_concurrent=1,max_retries=1,timeout=300"
    )
    got = _lm_eval_samples("local-completions", args, tasks)
    (work / f"lm_eval_{a.label}.json").write_text(json.dumps(got))
    lls = [(g[0], r[0]) for gi, ri in zip(got["pdserve_mc"], ref["pdserve_mc"], strict=True)
           for g, r in zip(gi, ri, strict=True)]  # fmt: skip
    max_diff = max(abs(float(g) - float(r)) for g, r in lls)
    gen_same = sum(g == r for g, r in zip(got["pdserve_gen"], ref["pdserve_gen"], strict=True))
    n = len(got["pdserve_gen"])
    ok = max_diff <= 1e-4 and gen_same == n
    return {"ok": ok, "detail": f"loglikelihood max abs diff vs hf {max_diff:.2e} over {len(lls)}; "
            f"generate_until {gen_same}/{n} equal", "max_ll_diff": max_diff}  # fmt: skip


FLOWS = {"guidellm": guidellm, "aiperf": aiperf, "instructor": instructor,
         "langchain": langchain, "agents": agents, "lm_eval": lm_eval}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("flow", choices=sorted(FLOWS))
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--label", default="target")
    p.add_argument("--is-demo", action="store_true")
    a = p.parse_args()
    Path(a.work_dir).mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        result = FLOWS[a.flow](a)
    except Exception as exc:  # the flow's failure is its verdict, reported in the matrix
        result = {"ok": False, "detail": f"{type(exc).__name__}: {exc}"[:300]}
    result["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
