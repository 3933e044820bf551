"""``pdserve router``: parse flags into a RouterConfig and serve until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from pdserve.auth import add_key_args
from pdserve.cli_common import DeprecatedAlias, run_async, setup_logging
from pdserve.envs import Env, read_env
from pdserve.lifetime import add_parent_pid_arg, wait_for_stop
from pdserve.router.app import Router
from pdserve.router.config import POLICY_NAMES, READINESS_MODES, RouterConfig
from pdserve.tls import add_tls_args, tls_config_from_args

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The ``pdserve router`` flags (defaults from RouterConfig)."""
    d = RouterConfig()
    p = argparse.ArgumentParser(
        prog="pdserve router", description="PD-aware OpenAI-compatible router"
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    for flag, what in (("--prefill", "prefill"), ("--decode", "decode"), ("--worker", "colocated")):
        p.add_argument(
            flag, action="append", default=[], metavar="URL", help=f"{what} worker URL, repeatable"
        )
    p.add_argument("--policy", choices=POLICY_NAMES, default=d.policy)
    p.add_argument(
        "--cache-threshold", type=float, default=d.cache_threshold,
        help="cache_aware: a worker holding this fraction of a prompt's prefix gets it",
    )  # fmt: skip
    p.add_argument(
        "--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
        help="cache_aware: in-flight gap past which the least loaded worker gets the request",
    )  # fmt: skip
    p.add_argument(
        "--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
        help="cache_aware: ... when also more than this ratio of the least loaded's load",
    )  # fmt: skip
    _add_timing_flags(p, d)
    p.add_argument("--max-attempts", type=int, default=d.max_attempts)
    p.add_argument("--breaker-failures", type=int, default=d.breaker_failures)
    p.add_argument(
        "--max-worker-queue", type=int, default=d.max_worker_queue,
        help="a worker reporting this many queued requests takes no more; when no decode (or "
        "colocated worker) can take a request soon the router answers 429 + Retry-After",
    )  # fmt: skip
    p.add_argument(
        "--max-prefill-backlog-tokens", type=int, default=d.max_prefill_backlog_tokens,
        metavar="N", help="a prefilling worker with N prompt tokens queued (reported, or sent by "
        "this router and not prefilled yet) takes no more; when none can, 429 + Retry-After",
    )  # fmt: skip
    p.add_argument(
        "--migration-limit", type=int, default=d.migration_limit, metavar="N",
        help="resume a stream broken mid-answer on another path up to N times (0: off)",
    )  # fmt: skip
    p.add_argument(
        "--enforce-disagg", action="store_true",
        help="never let a decode worker prefill itself when no prefill worker is healthy",
    )  # fmt: skip
    p.add_argument(
        "--readiness", choices=READINESS_MODES, default=d.readiness,
        help="what GET /health/ready requires: serving = any path that serves, the decode "
        "fallback included; pd = a prefill+decode pair (GET /health/pd always answers that)",
    )  # fmt: skip
    p.add_argument(
        "--max-body-kb", type=int, default=d.max_body_bytes >> 10,
        help="larger request bodies get 413 (as on workers)",
    )  # fmt: skip
    p.add_argument(
        "--max-body-bytes", action=DeprecatedAlias, new="--max-body-kb", type=int, default=None
    )
    _add_access_flags(p)
    p.add_argument("--log-level", default=None, help="default $PDSERVE_LOG_LEVEL, else INFO")
    add_tls_args(p)
    add_parent_pid_arg(p)
    return p


def _add_access_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("access (docs/operations.md, Access)")
    add_key_args(g, admin_opens="/workers, /debug/*")
    g.add_argument(
        "--registration-token", default=None, metavar="SECRET",
        help="what workers' self-registration must carry (--router of pdserve serve); without "
        "it registration is open to --worker-allow ($PDSERVE_REGISTRATION_TOKEN)",
    )  # fmt: skip
    g.add_argument(
        "--worker-api-key", default=None, metavar="KEY",
        help="the workers' client key, sent on every call to them (default: the first "
        "--api-key; $PDSERVE_WORKER_API_KEY)",
    )  # fmt: skip
    g.add_argument(
        "--worker-allow", action="append", default=[], metavar="CIDR|HOST",
        help="hosts a registered or added worker URL may name (a CIDR, a host name, or "
        ".domain for every name under it); repeatable; default: loopback and this machine's "
        "networks",
    )  # fmt: skip
    g.add_argument(
        "--served-model-name", default=None, metavar="NAME",
        help="the model a registered or added worker must serve (default: the model the "
        "healthy fleet serves; the first worker sets it)",
    )  # fmt: skip


def _add_timing_flags(p: argparse.ArgumentParser, d: RouterConfig) -> None:
    seconds = [
        ("--health-interval", d.health_interval_s, "seconds between health checks"),
        ("--health-timeout", d.health_timeout_s, "bound on one health probe"),
        ("--request-timeout", d.request_timeout_s, "bound on one leg / one streamed answer"),
        ("--connect-timeout", d.connect_timeout_s, "bound on connecting to a worker"),
        ("--first-byte-timeout", None, "retry elsewhere if no first event by then"),
        ("--backoff-base", d.backoff_base_s, "first retry backoff (doubles, with jitter)"),
        ("--breaker-reset", d.breaker_reset_s, "open breaker turns half-open after this"),
        ("--drain-timeout", d.drain_timeout_s, "SIGTERM: finish requests in flight this long"),
        (
            "--sse-keepalive-s",
            d.sse_keepalive_s,
            "': keep-alive' SSE comments this often while a "
            "stream has no data yet (0: off); its workers are asked for none",
        ),
    ]
    for flag, default, help_text in seconds:
        p.add_argument(flag, type=float, default=default, metavar="S", help=help_text)


def config_from_args(args: argparse.Namespace, env: Env | None = None) -> RouterConfig:
    """RouterConfig from parsed flags; ``env`` (pdserve/envs.py) fills in missing secrets."""
    env = env or Env()
    api_keys = tuple(args.api_key or ()) or env.api_keys
    return RouterConfig(
        host=args.host,
        port=args.port,
        prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode),
        worker_urls=tuple(args.worker),
        policy=args.policy,
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        request_timeout_s=args.request_timeout,
        connect_timeout_s=args.connect_timeout,
        first_byte_timeout_s=args.first_byte_timeout,
        max_attempts=args.max_attempts,
        migration_limit=args.migration_limit,
        enforce_disagg=args.enforce_disagg,
        readiness=args.readiness,
        backoff_base_s=args.backoff_base,
        breaker_failures=args.breaker_failures,
        breaker_reset_s=args.breaker_reset,
        max_worker_queue=args.max_worker_queue,
        max_prefill_backlog_tokens=args.max_prefill_backlog_tokens,
        drain_timeout_s=args.drain_timeout,
        api_key=api_keys[0] if len(api_keys) == 1 else api_keys or None,
        admin_api_key=args.admin_api_key or env.admin_api_key,
        registration_token=args.registration_token or env.registration_token,
        metrics_open=args.metrics_open,
        worker_api_key=args.worker_api_key or env.worker_api_key or next(iter(api_keys), None),
        worker_allow=tuple(args.worker_allow),
        served_model_name=args.served_model_name,
        sse_keepalive_s=args.sse_keepalive_s,
        max_body_bytes=args.max_body_bytes or args.max_body_kb << 10,
        tls=tls_config_from_args(args),
    )


async def serve(config: RouterConfig, parent_pid: int | None = None) -> None:
    """Run a router until SIGINT, or SIGTERM and a drain (or until ``parent_pid`` is no longer
    its parent). A second SIGTERM stops at once."""
    stop = asyncio.Event()
    drain = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, lambda: stop.set() if drain.is_set() else drain.set())
    async with Router(config) as router:
        print(f"pdserve router ready at {router.url}", flush=True)
        stopping = asyncio.ensure_future(wait_for_stop(stop, parent_pid))
        draining = asyncio.ensure_future(drain.wait())
        await asyncio.wait({stopping, draining}, return_when=asyncio.FIRST_COMPLETED)
        if drain.is_set() and not stop.is_set():
            drained = asyncio.ensure_future(router.drain())
            await asyncio.wait({stopping, drained}, return_when=asyncio.FIRST_COMPLETED)
            drained.cancel()
        stopping.cancel()
        draining.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (``pdserve router ...``); returns the exit status."""
    env = read_env()
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        config = config_from_args(args, env)
    except ValueError as exc:
        print(f"pdserve router: {exc}", file=sys.stderr)
        return 2
    if not (config.prefill_urls or config.decode_urls or config.worker_urls):
        logger.warning("no workers given: start workers with --router URL, or POST /workers")
    run_async(serve(config, args.parent_pid))
    return 0
