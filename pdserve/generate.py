"""`pdserve generate`: offline generation from the command line, through :class:`pdserve.llm.LLM`.

``pdserve generate --model DIR --prompt TEXT [--prompt-ids 1,2,3] --max-tokens N
[--temperature T --seed S] [--json]``. Without ``--model`` the built-in demo model is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from pdserve.engine.scheduler import SchedulerConfig
from pdserve.llm import LLM
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sampling_params import SamplingParams


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve generate", description=__doc__)
    p.add_argument("--model", help="HF model directory (default: the built-in demo model)")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], help="comma-separated ids")
    p.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--max-prefill-tokens", "--max-num-batched-tokens", dest="max_prefill_tokens", type=int,
        default=2048, help="tokens computed per step (as `pdserve serve`)",
    )  # fmt: skip
    p.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
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
    if args.model is None:
        from pdserve.model.demo import ensure_demo_model

        args.model = str(ensure_demo_model())
    runner = ModelRunner(
        RunnerConfig(
            model_dir=args.model,
            dtype=args.dtype,
            device=args.device,
            kv_cache_bytes=args.kv_cache_mib * 2**20,
        )
    )
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill=args.chunked_prefill,
        prefix_caching=args.prefix_caching,
    )
    with LLM(runner, scheduler) as llm:
        results = llm.generate(_prompts(args, runner), sampling)
    for result in results:
        if args.json:
            print(json.dumps(dataclasses.asdict(result), ensure_ascii=False))
        else:
            print(result.text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
