"""`pdserve generate`: offline generation from the command line, through :class:`pdserve.llm.LLM`.

``pdserve generate --model DIR --prompt TEXT [--prompt-ids 1,2,3] --max-tokens N
[--temperature T --seed S] [--json]``, plus the runner flags of ``pdserve serve`` (``--dtype``,
``--kv-cache-mb``, ...). Without ``--model``: the fetched default model, else the demo model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from pdserve.cli_common import UNSERVABLE, DeprecatedAlias, add_runner_args, setup_logging
from pdserve.config_builder import runner_config_from_args, scheduler_config_from_args
from pdserve.device import DEFAULT_GPU_MEMORY_UTILIZATION, add_device_args
from pdserve.engine.protocol import EngineError
from pdserve.llm import LLM
from pdserve.model_runner import ModelRunner
from pdserve.sampling_params import SamplingParams


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve generate", description=__doc__)
    p.add_argument("--model", help="HF model dir or GGUF file (default: as `pdserve serve`)")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], help="comma-separated ids")
    p.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    add_device_args(p, DEFAULT_GPU_MEMORY_UTILIZATION)
    add_runner_args(p)
    p.add_argument(
        "--kv-cache-mib", action=DeprecatedAlias, new="--kv-cache-mb", dest="kv_cache_mb", type=int
    )
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument("--log-level", default="WARNING", help="logs go to stderr (default WARNING)")
    return p.parse_args(argv)


def _prompts(args: argparse.Namespace, runner: ModelRunner) -> list[list[int]]:
    tok = runner.tokenizer
    prompts = []
    for text in args.prompt:
        if args.chat:
            rendered = tok.apply_chat_template([{"role": "user", "content": text}])
            prompts.append(tok.encode(rendered, add_special_tokens=False))
        else:
            prompts.append(tok.encode(text))
    for spec in args.prompt_ids:
        prompts.append([int(x) for x in spec.split(",") if x.strip()])
    return prompts


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pdserve generate``; returns the process exit status."""
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    if not args.prompt and not args.prompt_ids:
        print("pdserve generate: give at least one --prompt or --prompt-ids", file=sys.stderr)
        return 2
    setup_logging(args.log_level)
    try:
        config = runner_config_from_args(args)
    except ValueError as e:  # a flag this model refuses (--tensor-parallel-size)
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2
    try:
        runner = ModelRunner(config)
    except UNSERVABLE as e:
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    try:
        with LLM(runner, scheduler_config_from_args(args)) as llm:
            results = llm.generate(_prompts(args, runner), sampling)
    except EngineError as e:  # the engine died (a lost tensor-parallel rank)
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 1
    for result in results:
        if args.json:
            print(json.dumps(dataclasses.asdict(result), ensure_ascii=False))
        else:
            print(result.text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
