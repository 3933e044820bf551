"""Command line: `pdserve serve|router|up|generate|make-demo-model`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from pdserve.envs import quiet_nixl_logs, read_env

DEFAULT_GIL_SWITCH_INTERVAL_MS = 0.5
T = TypeVar("T")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF-format model dir (default: built-in demo)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--kv-cache-mb", type=int, default=512, help="KV cache size in MiB")
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


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--role", default="colocated", choices=["prefill", "decode", "colocated"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default 30001 prefill, 30002 decode")
    p.add_argument("--bootstrap-port", type=int, default=8998, help="prefill: KV bootstrap port")
    p.add_argument("--engine-id", default=None)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--max-body-kb", type=int, default=4096, help="larger request bodies get 413")
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--kv-checksum", action="store_true", help="verify a checksum of KV pages")
    p.add_argument(
        "--cpu-lease", default=None, metavar="FILE",
        help="workers on one machine given the same file take turns running model steps, each "
        "on all its threads (pdserve up sets it for its prefill and decode workers)",
    )  # fmt: skip
    p.add_argument(
        "--fault-plan",
        default=None,
        metavar="JSON",
        help="testing only: inject KV transport faults, e.g. "
        '\'{"delay_s": 0.01, "drop_notif_prob": 0.1, "fail_transfer_prob": 0.05, "seed": 1}\' '
        "(fields of pdserve.transport.faults.FaultPlan)",
    )
    g = p.add_argument_group("deadlines (seconds)")
    g.add_argument("--timeout-bootstrap", type=float, default=30.0)
    g.add_argument("--timeout-waiting-for-input", type=float, default=60.0)
    g.add_argument("--timeout-transfer", type=float, default=30.0)
    g.add_argument("--timeout-queue", type=float, default=60.0)
    g.add_argument("--timeout-waiting-for-kv", type=float, default=120.0)
    g.add_argument("--timeout-request", type=float, default=None, help="overall, off by default")
    g.add_argument(
        "--abort-quarantine", type=float, default=5.0,
        help="decode: hold a dead sender's destination pages this long before reuse",
    )  # fmt: skip
    g.add_argument(
        "--bootstrap-connect-timeout", type=float, default=2.0,
        help="refused connections to a prefill's bootstrap server for this long fail the room",
    )  # fmt: skip
    g.add_argument(
        "--bootstrap-request-timeout", type=float, default=5.0,
        help="one HTTP request to a bootstrap server",
    )  # fmt: skip
    p.add_argument("--log-level", default=None)
    p.add_argument(
        "--gil-switch-interval-ms",
        type=float,
        default=DEFAULT_GIL_SWITCH_INTERVAL_MS,
        help="how long the event loop may hold the GIL while the runner thread waits for it "
        "(Python's default is 5 ms; 0 keeps it)",
    )


def apply_gil_switch_interval(ms: float) -> None:
    """Process-wide: the runner thread re-takes the GIL between torch ops, and while the event
    loop runs Python (HTTP, detokenization) it may wait up to this long each time. 2-core box,
    tiny model, 4 interleaved runs: 0.5 ms lowered batch-1 TPOT every time (-2% quiet to -39%
    under load); batch 8 was mixed (+7% to -39%)."""
    if ms > 0:
        sys.setswitchinterval(ms / 1000)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_nixl_logs()
    commands = {
        "serve": _serve,
        "router": _router,
        "up": _up,
        "generate": _generate,
        "make-demo-model": _make_demo,
    }
    if not argv or argv[0] not in commands:
        print(f"usage: pdserve {{{','.join(commands)}}} [--help]", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


def setup_logging(level: str | None) -> None:
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


def _serve(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve serve")
    add_serve_args(p)
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    from pdserve.config_builder import server_config_from_args

    try:
        config = server_config_from_args(args)
    except ValueError as e:  # a bad flag value: a usage error, not a traceback
        p.error(str(e))
    apply_gil_switch_interval(args.gil_switch_interval_ms)
    run_async(_serve_forever(config))
    return 0


async def _serve_forever(config: object) -> None:
    from pdserve.server import Server

    server = Server(config)  # type: ignore[arg-type]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    print(f"pdserve {server.config.role} serving at {server.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


def _router(argv: list[str]) -> int:
    from pdserve.router import main as router_main

    return router_main(argv)


def _up(argv: list[str]) -> int:
    from pdserve.launcher import main as up_main

    return up_main(argv)


def _generate(argv: list[str]) -> int:
    from pdserve.generate import main as generate_main

    return generate_main(argv)


def _make_demo(argv: list[str]) -> int:
    from pdserve.model.demo import main as demo_main

    return demo_main(argv)


def resolve_model_dir(model: str | None) -> Path:
    """The given model dir, or the built-in demo model (created on first use)."""
    if model:
        return Path(model)
    from pdserve.model.demo import default_demo_dir, ensure_demo_model

    return ensure_demo_model(default_demo_dir())


if __name__ == "__main__":
    raise SystemExit(main())
