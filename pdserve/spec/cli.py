"""Speculative decoding's flags (vLLM's names where vLLM has one) and their config."""

from __future__ import annotations

import argparse

from pdserve.spec.config import METHODS, SpeculativeConfig


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (exact: the tokens are the plain stream's)")
    g.add_argument(
        "--speculative-method", choices=METHODS, default=None,
        help="ngram: prompt lookup in the request's own tokens; draft: a smaller model of the "
        "same tokenizer (--speculative-model); default: off (draft when a model is given)",
    )  # fmt: skip
    g.add_argument(
        "--speculative-model", default=None,
        help="the draft model's directory or GGUF file (implies --speculative-method draft)",
    )  # fmt: skip
    g.add_argument(
        "--num-speculative-tokens", type=int, default=4,
        help="most tokens drafted per request and step (draft: the adaptive K's ceiling)",
    )  # fmt: skip
    g.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: shortest n-gram")
    g.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest n-gram")
    g.add_argument(
        "--speculative-disable-batch-size", type=int, default=4,
        help="a decode batch of more requests than this does not speculate (a K-row verify "
        "costs about K decode rows once a CPU step is compute-bound)",
    )  # fmt: skip
    g.add_argument(
        "--speculative-adaptive", action=argparse.BooleanOptionalAction, default=True,
        help="speculate only at batch sizes where it measured faster than plain decode steps "
        "(re-measured now and then); off: whenever there are drafts",
    )  # fmt: skip


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    method = getattr(args, "speculative_method", None)
    model = getattr(args, "speculative_model", None)
    if method is None and model is None:
        return None
    return SpeculativeConfig(
        method=method or "draft",
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
        draft_model=model,
        disable_batch_size=args.speculative_disable_batch_size,
        adaptive=args.speculative_adaptive,
    )


def speculative_worker_args(args: argparse.Namespace) -> list[str]:
    """The speculative flags as a worker's command line (`pdserve up` hands them to its decode
    workers: the decode role is where a PD stream's tokens are generated); none when off."""
    if speculative_config_from_args(args) is None:
        return []
    out = (
        [] if args.speculative_method is None else ["--speculative-method", args.speculative_method]
    )
    out += [] if args.speculative_model is None else ["--speculative-model", args.speculative_model]
    out += ["--num-speculative-tokens", str(args.num_speculative_tokens),
            "--prompt-lookup-min", str(args.prompt_lookup_min),
            "--prompt-lookup-max", str(args.prompt_lookup_max),
            "--speculative-disable-batch-size",
            str(args.speculative_disable_batch_size)]  # fmt: skip
    return out + ([] if args.speculative_adaptive else ["--no-speculative-adaptive"])
