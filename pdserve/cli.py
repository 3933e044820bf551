"""Command line: `pdserve serve|router|up|generate|make-demo-model`."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import TYPE_CHECKING

from pdserve.auth import add_key_args
from pdserve.cli_common import (
    TOOL_PARSER_CHOICES,
    UNSERVABLE,
    DeprecatedAlias,
    add_model_args,
    run_async,
    setup_logging,
)
from pdserve.device import DEFAULT_GPU_MEMORY_UTILIZATION, add_device_args
from pdserve.envs import quiet_nixl_logs
from pdserve.lifetime import add_parent_pid_arg, wait_for_stop
from pdserve.reasoning.parser import PARSERS
from pdserve.spec.cli import add_speculative_args
from pdserve.tls import add_tls_args

if TYPE_CHECKING:
    from pdserve.server import Server

DEFAULT_GIL_SWITCH_INTERVAL_MS = 0.5


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_speculative_args(p)
    add_device_args(p, DEFAULT_GPU_MEMORY_UTILIZATION)
    p.add_argument("--role", default="colocated", choices=["prefill", "decode", "colocated"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default 30001 prefill, 30002 decode")
    p.add_argument("--bootstrap-port", type=int, default=8998, help="prefill: KV bootstrap port")
    p.add_argument(
        "--advertise-host", default=None,
        help="the host routers and peers reach this worker at (registration URL, bootstrap "
        "address, default engine id); default --host, or this machine's address if that is "
        "a wildcard such as 0.0.0.0",
    )  # fmt: skip
    p.add_argument("--engine-id", default=None, help="default <role>-<advertised host>:<port>")
    p.add_argument(
        "--bootstrap-token", default=None, metavar="SECRET",
        help="shared secret of the KV bootstrap port: a prefill refuses requests without it "
        "(401), a decode sends it; give both the same ($PDSERVE_BOOTSTRAP_TOKEN)",
    )  # fmt: skip
    _add_registration_args(p)
    add_tls_args(p)
    add_key_args(p, admin_opens="/drain, /debug/*")  # a router's --worker-api-key is a client key
    p.add_argument("--max-body-kb", type=int, default=4096, help="larger request bodies get 413")
    p.add_argument(
        "--json-schema-extra-keys", action="store_true",
        help="JSON schemas that say nothing of additionalProperties allow undeclared keys (JSON "
        "Schema's reading); by default they do not, as in vLLM (xgrammar's strict mode)",
    )  # fmt: skip
    p.add_argument(
        "--reasoning-parser", default=None, choices=sorted(PARSERS),
        help="split a thinking model's <think>...</think> block off its answer: "
        "reasoning_content in chat responses, grammars start after it (vLLM's names)",
    )  # fmt: skip
    p.add_argument(
        "--sse-keepalive-s", type=float, default=15.0, metavar="S",
        help="a stream waiting this long for its first token gets a ': keep-alive' SSE comment, "
        "then one every S seconds until it (0: off); a router sends its own and asks for none",
    )  # fmt: skip
    p.add_argument(
        "--tool-call-parser", default="auto", choices=TOOL_PARSER_CHOICES,
        help="how tool calls are read from the model's text (vLLM's names); auto: the format the "
        "chat template shows (<tool_call> -> hermes, [TOOL_CALLS] -> mistral, ...)",
    )  # fmt: skip
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
    g.add_argument("--timeout-queue", type=float, default=60.0, help="waiting for a prefill slot")
    g.add_argument(
        "--timeout-prefill-progress", type=float, default=60.0,
        help="prefilling: a prompt whose prefill makes no progress (no prefill step ends) for "
        "this long fails; each step renews it, so a long prompt is never cut off while it moves",
    )  # fmt: skip
    g.add_argument("--timeout-waiting-for-kv", type=float, default=120.0)
    g.add_argument(
        "--timeout-request", type=float, default=None,
        help="overall, in any state; default: --timeout-request-base + --timeout-per-token x "
        "(prompt + max_tokens tokens, at most --max-model-len)",
    )  # fmt: skip
    g.add_argument("--timeout-request-base", type=float, default=60.0)
    g.add_argument("--timeout-per-token", type=float, default=1.0)
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
    p.add_argument(
        "--drain-timeout", type=float, default=30.0,
        help="SIGTERM or POST /drain: readiness off, new requests get a retryable 503, and "
        "requests and KV transfers in flight get this many seconds to finish",
    )  # fmt: skip
    p.add_argument("--log-level", default=None, help="default $PDSERVE_LOG_LEVEL, else INFO")
    add_parent_pid_arg(p)
    p.add_argument(
        "--gil-switch-interval-ms",
        type=float,
        default=DEFAULT_GIL_SWITCH_INTERVAL_MS,
        help="how long the event loop may hold the GIL while the runner thread waits for it "
        "(Python's default is 5 ms; 0 keeps it)",
    )


def _add_registration_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("self-registration with routers")
    g.add_argument(
        "--router", action="append", default=[], metavar="URL",
        help="register with this router and renew the lease; repeatable",
    )  # fmt: skip
    g.add_argument(
        "--register-interval", type=float, default=2.0, metavar="S",
        help="seconds between lease renewals",
    )  # fmt: skip
    g.add_argument(
        "--register-ttl", type=float, default=6.0, metavar="S",
        help="a router forgets this worker this long after its last renewal",
    )  # fmt: skip
    g.add_argument(
        "--registration-token", default=None, metavar="SECRET",
        help="the routers' --registration-token, sent with every registration "
        "($PDSERVE_REGISTRATION_TOKEN)",
    )  # fmt: skip
    g.add_argument(
        "--router-api-key", action=DeprecatedAlias, new="--registration-token",
        dest="registration_token", default=None,
    )  # fmt: skip


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
        "fetch-model": _fetch_model,
    }
    if not argv or argv[0] not in commands:
        print(f"usage: pdserve {{{','.join(commands)}}} [--help]", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


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
    try:
        failure = run_async(_serve_forever(config, args.parent_pid))
    except UNSERVABLE as e:  # the server failed to start: say why, without a traceback
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    if failure is not None:  # the engine died (a lost tensor-parallel rank): not a clean stop
        print(f"pdserve serve: {failure}", file=sys.stderr)
        return 1
    return 0


async def _serve_forever(config: object, parent_pid: int | None = None) -> str | None:
    """Serve until stopped; why the engine failed if that is what stopped it, else None."""
    from pdserve.server import Server

    server = Server(config)  # type: ignore[arg-type]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # SIGINT stops at once; SIGTERM (a process manager, `pdserve up`, Kubernetes) drains first,
    # as POST /drain does. A second SIGTERM while draining stops at once.
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, lambda: _on_sigterm(server, stop))
    server.drain_gate.on_begin(lambda _reason: _stop_after_drain(server, stop))
    await server.start()
    assert server.engine is not None
    health = server.engine.health
    health.on_fatal(lambda _error: stop.set())  # exit non-zero: supervisors see the worker gone
    print(f"pdserve {server.config.role} serving at {server.url}", flush=True)
    try:
        await wait_for_stop(stop, parent_pid)
    finally:
        await server.stop()
    return str(health.error) if health.error is not None else None


def _on_sigterm(server: Server, stop: asyncio.Event) -> None:
    if not server.drain_gate.begin("SIGTERM"):
        stop.set()


def _stop_after_drain(server: Server, stop: asyncio.Event) -> None:
    # Runs after the server's own listener, which started the drain task: once the drain ends
    # (idle, or its timeout), the process stops and exits 0.
    assert server.drained is not None
    server.drained.add_done_callback(lambda _task: stop.set())


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


def _fetch_model(argv: list[str]) -> int:
    from pdserve.model.fetch import main as fetch_main

    return fetch_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
