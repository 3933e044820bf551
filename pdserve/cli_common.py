"""What every ``pdserve`` command shares: the model flags, the model directory, logging and the
event loop. Below cli.py, launcher.py, config_builder.py and router/cli.py, so that none of them
imports the top command module back (no import circle)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from pdserve.envs import read_env
from pdserve.model.config import ModelDirError
from pdserve.model.dtype import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES, UnsupportedDtypeError

T = TypeVar("T")
# Errors of a model (directory, dtype) that a command cannot serve: a message, not a traceback.
UNSERVABLE = (ModelDirError, UnsupportedDtypeError)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags of every command that serves a model (serve, up)."""
    p.add_argument(
        "--model", default=None,
        help="HF-format model dir, or a GGUF file (or a dir holding one); default: "
        "SmolLM2-135M-Instruct fetched by `pdserve fetch-model`, else the built-in demo",
    )  # fmt: skip
    p.add_argument("--served-model-name", default=None)
    add_runner_args(p)
    p.add_argument(
        "--decode-threads", type=_threads_or_auto, default=None, metavar="{auto,N}",
        help="torch threads of decode steps; auto (default): 1 unless more are >= 1.3x faster "
        "in a start-up measurement (or one thread needs >= 20 ms per step)",
    )  # fmt: skip


def add_runner_args(p: argparse.ArgumentParser) -> None:
    """The flags of every command that loads a model (serve, up, generate): one name each."""
    p.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES,
        help="auto (default): the checkpoint's torch_dtype (a float16 one runs in bfloat16 on "
        "CPU); an explicit dtype converts the weights on load (float16: CUDA only)",
    )  # fmt: skip
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
        help="auto (default): the weights' dtype (bfloat16 for a bf16 checkpoint; on CPUs K/V "
        "are computed in float32 and rounded once, when stored); float32 keeps them exact "
        "(2x the KV memory; CPU only for a bf16 model)",
    )  # fmt: skip
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument(
        "--kv-cache-mb", type=int, default=None,
        help="KV cache size in MiB (default: 512 on CPU; on CUDA what --gpu-memory-utilization "
        "leaves after weights, activations and CUDA graphs)",
    )  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--max-prefill-tokens", "--max-num-batched-tokens", dest="max_prefill_tokens", type=int,
        default=2048, help="tokens computed per step: prompt chunks plus one per running stream "
        "(vLLM's --max-num-batched-tokens); with --no-chunked-prefill, one prefill batch's budget",
    )  # fmt: skip
    p.add_argument(
        "--chunked-prefill", "--enable-chunked-prefill", dest="chunked_prefill",
        action=argparse.BooleanOptionalAction, default=True,
        help="prefill prompts in chunks that share each step with the running streams' decode "
        "rows (off: a whole prompt batch runs first and the streams wait for it)",
    )  # fmt: skip
    p.add_argument(
        "--prefix-caching", "--enable-prefix-caching", dest="prefix_caching",
        action=argparse.BooleanOptionalAction, default=True,
        help="keep full KV pages of finished and running prompts and reuse them for prompts "
        "with the same prefix (LRU-evicted when pages run out)",
    )  # fmt: skip
    p.add_argument(
        "--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
        help="fcfs: arrival order; priority: a request's 'priority' field, lower first (ties "
        "by arrival), and a waiting request may preempt running ones of a lower priority",
    )  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--num-threads", type=int, default=None,
        help="torch intra-op threads (prefill; decode's most); default: torch's (all cores)",
    )  # fmt: skip
    p.add_argument(
        "--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=tp_size_arg, default=1,
        metavar="N", help="split the model over N rank processes (CPU only; the model's heads, "
        "KV heads and MLP must divide by N); any role: a prefill and a decode of different "
        "sizes pair",
    )  # fmt: skip


def tp_size_arg(value: str) -> int:
    """argparse type of a tensor-parallel size (an int >= 1)."""
    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a rank count, got {value!r}") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"tensor parallel size must be >= 1, got {size}")
    return size


class DeprecatedAlias(argparse.Action):
    """An old flag name that still works, with a warning naming the new one.

    ``p.add_argument("--old", action=DeprecatedAlias, new="--new", dest=..., type=...)``.
    """

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, help=f"deprecated: use {new}", **kwargs)
        self.new = new

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog}: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _threads_or_auto(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        threads = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or a thread count, got {value!r}"
        ) from None
    if threads < 1:
        raise argparse.ArgumentTypeError(f"thread count must be >= 1, got {threads}")
    return threads


def setup_logging(level: str | None) -> None:
    """Log to stderr at ``level`` (else $PDSERVE_LOG_LEVEL); a no-op once logging is set up."""
    logging.basicConfig(
        level=(level or read_env().log_level).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on uvloop (on asyncio's own loop where uvloop is missing); its result."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency, but stay usable without
        return asyncio.run(coro)
    return uvloop.run(coro)


def resolve_model_dir(model: str | None) -> Path:
    """The given model (dir or GGUF file), else $PDSERVE_MODEL, else the fetched default model,
    else the built-in demo (created on first use)."""
    model = model or read_env().model_dir
    if model:
        return Path(model)
    from pdserve.model.fetch import default_model_or_demo

    return default_model_or_demo()


def served_model_name(given: str | None, model_dir: str) -> str:
    """``--served-model-name``, else the model directory's name (the demo's: ``demo-model``),
    or a GGUF file's without its quantization (``SmolLM2-135M-Instruct``)."""
    from pdserve.model.checkpoint import default_served_name

    return given or default_served_name(model_dir)


# pdserve.api.tool_parsers.CHOICES, spelled out so the CLIs (serve, up) do not import the HTTP
# layer (tests/api/tool_parsers/test_registry.py holds the two equal).
TOOL_PARSER_CHOICES = ("auto", "hermes", "llama3_json", "mistral", "qwen3_coder", "qwen3_xml",
                       "pythonic")  # fmt: skip
