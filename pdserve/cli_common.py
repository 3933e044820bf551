"""What every ``pdserve`` command shares: the model flags, the model directory, logging and the
event loop. Below cli.py, launcher.py, config_builder.py and router/cli.py, so that none of them
imports the top command module back (no import circle)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from pdserve.envs import read_env

T = TypeVar("T")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags of every command that loads a model (serve, up)."""
    p.add_argument("--model", default=None, help="HF-format model dir (default: built-in demo)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--kv-cache-mb", type=int, default=512, help="KV cache size in MiB")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-prefill-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--num-threads", type=int, default=None,
        help="torch intra-op threads (prefill; decode's most); default: torch's (all cores)",
    )  # fmt: skip
    p.add_argument(
        "--decode-threads", type=_threads_or_auto, default=None, metavar="{auto,N}",
        help="torch threads of decode steps; auto (default): 1 unless more are >= 1.3x faster "
        "in a start-up measurement (or one thread needs >= 20 ms per step)",
    )  # fmt: skip


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
    """The given model dir, or the built-in demo model (created on first use)."""
    if model:
        return Path(model)
    from pdserve.model.demo import default_demo_dir, ensure_demo_model

    return ensure_demo_model(default_demo_dir())
