"""`pdserve up`: a local PD cluster (prefill + decode + router) as child processes on 127.0.0.1."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from pdserve.cli import add_model_args, resolve_model_dir


@dataclass(frozen=True)
class ClusterConfig:
    model_dir: str
    served_model_name: str
    router_port: int = 30000
    prefill_port: int = 30001
    decode_port: int = 30002
    bootstrap_port: int = 8998
    ready_timeout_s: float = 600.0
    extra_worker_args: tuple[str, ...] = ()  # both workers
    # Both workers share this machine's cores: their model steps take turns (engine/cpu_lease.py).
    cpu_lease_path: str | None = None


@dataclass
class Child:
    name: str
    url: str
    argv: list[str]
    proc: subprocess.Popen[bytes]
    restarts: list[float] = field(default_factory=list)

    def restart(self) -> None:
        self.restarts.append(time.monotonic())
        self.proc = _popen(self.name, self.argv)


def _popen(name: str, argv: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pdserve", *argv]
    print(f"[up] starting {name}: {' '.join(cmd[2:])}", flush=True)
    return subprocess.Popen(cmd, start_new_session=True)


def _spawn(name: str, argv: list[str], url: str) -> Child:
    return Child(name, url, argv, _popen(name, argv))


def child_specs(cfg: ClusterConfig) -> list[tuple[str, list[str], str]]:
    """(name, `pdserve` argv, url) of the prefill, decode and router processes."""
    host = "127.0.0.1"
    common = ["--model", cfg.model_dir, "--served-model-name", cfg.served_model_name,
              *cfg.extra_worker_args]  # fmt: skip
    if cfg.cpu_lease_path:
        common += ["--cpu-lease", cfg.cpu_lease_path]
    prefill_url = f"http://{host}:{cfg.prefill_port}"
    decode_url = f"http://{host}:{cfg.decode_port}"
    return [
        ("prefill", ["serve", "--role", "prefill", "--port", str(cfg.prefill_port),
                     "--bootstrap-port", str(cfg.bootstrap_port), *common], prefill_url),
        ("decode", ["serve", "--role", "decode", "--port", str(cfg.decode_port), *common],
         decode_url),
        ("router", ["router", "--port", str(cfg.router_port), "--prefill", prefill_url,
                    "--decode", decode_url], f"http://{host}:{cfg.router_port}"),
    ]  # fmt: skip


def start_cluster(cfg: ClusterConfig) -> list[Child]:
    return [_spawn(name, argv, url) for name, argv, url in child_specs(cfg)]


def is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health/ready", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(children: list[Child], timeout_s: float) -> None:
    """Poll each child's readiness with a deadline; fail fast if one exits."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    delay = 0.05
    while pending:
        for child in list(pending):
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}")
            if is_ready(child.url):
                print(f"[up] {child.name} ready at {child.url}", flush=True)
                pending.remove(child)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {timeout_s:.0f}s: {[c.name for c in pending]}")
        if pending:
            time.sleep(delay)  # polling interval of a readiness check with a deadline
            delay = min(delay * 2, 1.0)


MAX_RESTARTS = 5  # within RESTART_WINDOW_S, then the cluster gives up
RESTART_WINDOW_S = 60.0


def supervise(children: list[Child]) -> int:
    """Restart a child that dies (the others keep running: no restart ordering); give up on one
    that keeps dying."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)  # block until any child exits (Ctrl-C interrupts)
        except ChildProcessError:
            return 1
        for child in children:
            if child.proc.pid != pid:
                continue
            code = child.proc.returncode = os.waitstatus_to_exitcode(status)
            now = time.monotonic()
            recent = [t for t in child.restarts if now - t < RESTART_WINDOW_S]
            if len(recent) >= MAX_RESTARTS:
                print(f"[up] {child.name} keeps exiting (code {code}); stopping", file=sys.stderr)
                return 1
            print(f"[up] {child.name} exited with code {code}; restarting", file=sys.stderr)
            child.restart()


def stop_cluster(children: list[Child], grace_s: float = 10.0) -> None:
    # A second Ctrl-C or SIGTERM must not interrupt the shutdown and orphan the children.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for child in reversed(children):
        if child.proc.poll() is None:
            os.killpg(child.proc.pid, signal.SIGTERM)
    for child in reversed(children):
        try:
            child.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve up", description=__doc__)
    add_model_args(p)
    p.add_argument("--router-port", type=int, default=30000)
    p.add_argument("--prefill-port", type=int, default=30001)
    p.add_argument("--decode-port", type=int, default=30002)
    p.add_argument("--bootstrap-port", type=int, default=8998)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument(
        "--cpu-lease", action=argparse.BooleanOptionalAction, default=True,
        help="the two workers take turns at this machine's cores for model steps, each with all "
        "its threads (off: they compute at once; then split the cores with --num-threads)",
    )  # fmt: skip
    return p.parse_args(argv)


def worker_args(args: argparse.Namespace) -> list[str]:
    """Every model/engine flag of `pdserve up`, passed on to both workers."""
    out = ["--dtype", args.dtype, "--page-size", str(args.page_size),
           "--kv-cache-mb", str(args.kv_cache_mb), "--max-num-seqs", str(args.max_num_seqs),
           "--max-prefill-tokens", str(args.max_prefill_tokens)]  # fmt: skip
    out += [] if args.chunked_prefill else ["--no-chunked-prefill"]
    out += [] if args.prefix_caching else ["--no-prefix-caching"]
    optional = {
        "--max-model-len": args.max_model_len,
        "--num-threads": args.num_threads,
        "--decode-threads": args.decode_threads,  # None is auto, the workers' default
    }
    for flag, value in optional.items():
        if value is not None:
            out += [flag, str(value)]
    return out


def cluster_config_from_args(args: argparse.Namespace) -> ClusterConfig:
    model_dir = str(resolve_model_dir(args.model))  # made once, before the children race for it
    return ClusterConfig(
        model_dir=model_dir,
        served_model_name=args.served_model_name or os.path.basename(model_dir.rstrip("/")),
        router_port=args.router_port,
        prefill_port=args.prefill_port,
        decode_port=args.decode_port,
        bootstrap_port=args.bootstrap_port,
        ready_timeout_s=args.ready_timeout,
        extra_worker_args=tuple(worker_args(args)),
        cpu_lease_path=default_lease_path(args.router_port) if args.cpu_lease else None,
    )


def default_lease_path(router_port: int) -> str:
    """One lease per user and cluster (its router port), kept across worker restarts."""
    name = f"pdserve-up-{os.getuid()}-{router_port}.cpu-lease"
    return os.path.join(tempfile.gettempdir(), name)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (kill, a process manager) stops the children like Ctrl-C


def main(argv: list[str]) -> int:
    cfg = cluster_config_from_args(parse_args(argv))
    signal.signal(signal.SIGTERM, _interrupt)
    children = start_cluster(cfg)
    try:
        wait_ready(children, cfg.ready_timeout_s)
        url = children[-1].url
        print(
            f"\npdserve PD cluster ready: {url}/v1  (model {cfg.served_model_name!r})", flush=True
        )
        print(
            f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{cfg.served_model_name}", '
            '"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}\'',
            flush=True,
        )
        print("Ctrl-C stops all.", flush=True)
        return supervise(children)
    except KeyboardInterrupt:
        print("\n[up] stopping", flush=True)
        return 0
    finally:
        stop_cluster(children)
