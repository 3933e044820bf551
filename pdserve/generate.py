"""Offline generation, like vLLM's ``LLM.generate``: prompts in, completions out, no server.

``pdserve generate --model DIR --prompt TEXT [--prompt-ids 1,2,3] --max-tokens N
[--temperature T --seed S] [--json]``, plus the runner flags of ``pdserve serve`` (``--dtype``,
``--kv-cache-mb``, ...). Without ``--model`` the built-in demo model is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from dataclasses import dataclass, field

from pdserve.cli_common import UNSERVABLE, DeprecatedAlias, add_runner_args, setup_logging
from pdserve.config_builder import runner_config_from_args
from pdserve.device import DEFAULT_GPU_MEMORY_UTILIZATION, add_device_args
from pdserve.kernels.kv_cache import PageAllocator
from pdserve.model.tokenizer import IncrementalDetokenizer
from pdserve.model_runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    stop_reason: str | int | None = None


@dataclass
class _Active:
    seq: Sequence
    detok: IncrementalDetokenizer
    text: str = ""
    finish: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[float] = field(default_factory=list)


def _stop_check(a: _Active, token: int, runner: ModelRunner) -> None:
    p = a.seq.sampling
    if token in p.stop_token_ids or (not p.ignore_eos and token in runner.tokenizer.eos_token_ids):
        a.finish, a.stop_reason = "stop", token
        return
    a.text += a.detok.step([token])
    for stop in p.stop:
        cut = a.text.find(stop)
        if cut >= 0:
            a.text, a.finish, a.stop_reason = a.text[:cut], "stop", stop
            return
    if a.seq.num_generated >= p.max_tokens or a.seq.num_tokens >= runner.max_model_len:
        a.finish = "length"


def _apply(active: list[_Active], tokens: list[int], runner: ModelRunner) -> None:
    for a, token in zip(active, tokens, strict=True):
        a.seq.num_cached_tokens = a.seq.num_tokens
        a.seq.token_ids.append(token)
        _stop_check(a, token, runner)


def _prefill_groups(active: list[_Active], max_tokens: int, max_seqs: int) -> list[list[_Active]]:
    groups: list[list[_Active]] = [[]]
    num_tokens = 0
    for a in active:
        if groups[-1] and (
            num_tokens + a.seq.num_tokens > max_tokens or len(groups[-1]) >= max_seqs
        ):
            groups.append([])
            num_tokens = 0
        groups[-1].append(a)
        num_tokens += a.seq.num_tokens
    return groups


def generate(
    runner: ModelRunner, prompts: list[list[int]], sampling: SamplingParams
) -> list[GenerationResult]:
    """Generate for every prompt (batched prefill, then batched decode steps) until done."""
    allocator = PageAllocator(runner.kv_config.num_pages)
    active: list[_Active] = []
    for i, ids in enumerate(prompts):
        budget = min(len(ids) + sampling.max_tokens, runner.max_model_len)
        pages = allocator.allocate(runner.kv_config.pages_for(budget))
        seq = Sequence(f"gen-{i}", list(ids), len(ids), dataclasses.replace(sampling), pages)
        active.append(_Active(seq, IncrementalDetokenizer(runner.tokenizer, ids)))
    try:
        cfg = runner.config
        for group in _prefill_groups(active, cfg.max_prefill_tokens, cfg.max_num_seqs):
            _apply(group, runner.prefill([a.seq for a in group]).token_ids, runner)
        running = [a for a in active if a.finish is None]
        while running:
            for start in range(0, len(running), cfg.max_num_seqs):
                chunk = running[start : start + cfg.max_num_seqs]
                _apply(chunk, runner.decode([a.seq for a in chunk]).token_ids, runner)
            running = [a for a in running if a.finish is None]
    finally:
        for a in active:
            allocator.free(a.seq.page_ids)
    return [
        GenerationResult(
            prompt_token_ids=prompts[i],
            token_ids=a.seq.generated_ids,
            text=a.text,  # like the server: a trailing incomplete character is not emitted
            finish_reason=a.finish or "length",
            stop_reason=a.stop_reason,
        )
        for i, a in enumerate(active)
    ]


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
    config = runner_config_from_args(args)
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
    for result in generate(runner, _prompts(args, runner), sampling):
        if args.json:
            print(json.dumps(dataclasses.asdict(result), ensure_ascii=False))
        else:
            print(result.text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
