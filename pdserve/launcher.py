"""`pdserve up`: a local PD cluster (prefills + decodes + router) as child processes on 127.0.0.1.

With ``--num-prefill N`` / ``--num-decode N`` the i-th worker of a role (from 0) listens on its
role's port + ``PORT_STRIDE * i`` (30001, 30011, ... and 30002, 30012, ...) and a prefill's
bootstrap port is ``--bootstrap-port`` + i.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from pdserve.envs import child_env
from pdserve.launcher_args import ClusterConfig, cluster_config_from_args, parse_args
from pdserve.lifetime import parent_death_preexec
from pdserve.model.checkpoint import check_model_config
from pdserve.model.config import ModelDirError
from pdserve.tls import TLSConfig

STOP_MARGIN_S = 10.0
# The router child is ready once the PD path is up (its /health/ready also counts a decode
# prefilling itself, which is what a balancer wants, not what "cluster ready" means).
READY_PATHS = {"router": "/health/pd"}


@dataclass
class Child:
    name: str
    url: str
    argv: list[str]
    proc: subprocess.Popen[bytes]
    env: dict[str, str] = field(default_factory=dict, repr=False)
    restarts: list[float] = field(default_factory=list)

    def restart(self) -> None:
        self.restarts.append(time.monotonic())
        self.proc = _popen(self.name, self.argv, self.env)


def _popen(name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    # A child lives no longer than this supervisor, even one that is SIGKILLed: the kernel's
    # parent-death signal, and the child's own watch on its parent pid (pdserve/lifetime.py).
    me = os.getpid()
    cmd = [sys.executable, "-m", "pdserve", *argv, "--parent-pid", str(me)]
    proc = subprocess.Popen(
        cmd, start_new_session=True, preexec_fn=parent_death_preexec(me), env=env
    )
    print(f"[up] started {name} (pid {proc.pid}): {' '.join(cmd[2:])}", flush=True)
    return proc


def _spawn(name: str, argv: list[str], url: str, env: dict[str, str]) -> Child:
    return Child(name, url, argv, _popen(name, argv, env), env)


def child_specs(cfg: ClusterConfig) -> list[tuple[str, list[str], str]]:
    """(name, `pdserve` argv, url) of the prefill, decode and router processes. With one worker
    of a role it is named after the role, else ``prefill-0``, ``prefill-1``, ..."""
    host = "127.0.0.1"
    common = ["--model", cfg.model_dir, "--served-model-name", cfg.served_model_name,
              *cfg.extra_worker_args]  # fmt: skip
    if cfg.cpu_lease_path:
        common += ["--cpu-lease", cfg.cpu_lease_path]
    common += ["--drain-timeout", str(cfg.drain_timeout_s)]
    router = ["router", "--port", str(cfg.router_port), "--drain-timeout", str(cfg.drain_timeout_s)]
    common, router = [*common, *cfg.tls.flags()], [*router, *cfg.tls.flags()]
    scheme = cfg.tls.scheme
    if cfg.policy is not None:
        router += ["--policy", cfg.policy]
    specs = []
    for role, ports, role_args in (("prefill", cfg.prefill_ports, cfg.prefill_args),
                                   ("decode", cfg.decode_ports, cfg.decode_args)):  # fmt: skip
        for i, port in enumerate(ports):
            name = role if len(ports) == 1 else f"{role}-{i}"
            argv = ["serve", "--role", role, "--port", str(port), *common, *role_args]
            if role == "prefill":
                argv[5:5] = ["--bootstrap-port", str(cfg.bootstrap_ports[i])]
            url = f"{scheme}://{host}:{port}"
            specs.append((name, argv, url))
            router += [f"--{role}", url]
    return [*specs, ("router", router, f"{scheme}://{host}:{cfg.router_port}")]


def start_cluster(cfg: ClusterConfig, children: list[Child]) -> None:
    """Start every child, appending each to ``children`` at once (so that a signal arriving
    half-way leaves the started ones in the list that stop_cluster stops)."""
    for name, argv, url in child_specs(cfg):
        children.append(_spawn(name, argv, url, child_secrets(cfg, name)))


def child_secrets(cfg: ClusterConfig, name: str) -> dict[str, str]:
    """A child's environment with the secrets its role needs (none on a command line): the
    router the user's client key and the workers' key, a worker its own client key."""
    router = name == "router"
    return child_env(
        bootstrap_token=cfg.bootstrap_token,
        PDSERVE_API_KEY=cfg.api_key if router else cfg.worker_api_key,
        PDSERVE_WORKER_API_KEY=cfg.worker_api_key if router else None,
        PDSERVE_ADMIN_API_KEY=cfg.admin_api_key,
    )


def is_ready(url: str, path: str = "/health/ready", tls: TLSConfig | None = None) -> bool:
    ctx = (tls or TLSConfig()).client_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=2, context=ctx) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(children: list[Child], timeout_s: float, tls: TLSConfig | None = None) -> None:
    """Poll each child's readiness with a deadline; fail fast if one exits."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    delay = 0.05
    while pending:
        for child in list(pending):
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}")
            if is_ready(child.url, READY_PATHS.get(child.name, "/health/ready"), tls):
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


def stop_cluster(children: list[Child], grace_s: float = 30.0 + STOP_MARGIN_S) -> None:
    """SIGTERM every child, which drains it (requests in flight finish, new ones are turned
    away with a retryable error), then wait ``grace_s`` for it to exit before SIGKILL."""
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


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (kill, a process manager) stops the children like Ctrl-C


def handle_stop_signals() -> None:
    """SIGINT and SIGTERM stop the cluster, whatever disposition this process inherited (a
    background job of a non-interactive shell starts with SIGINT ignored, and Python then
    installs no Ctrl-C handler of its own)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)


def main(argv: list[str]) -> int:
    try:  # refuse a model the workers cannot serve before starting any of them
        cfg = cluster_config_from_args(parse_args(argv))
        check_model_config(cfg.model_dir)
    except (ModelDirError, ValueError) as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    children: list[Child] = []
    handle_stop_signals()
    try:
        start_cluster(cfg, children)
        wait_ready(children, cfg.ready_timeout_s, cfg.tls)
        url = children[-1].url
        print(
            f"\npdserve PD cluster ready: {url}/v1  (model {cfg.served_model_name!r})", flush=True
        )
        auth = " -H 'Authorization: Bearer <your --api-key>'" if cfg.api_key else ""
        print(
            f"try: curl {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{cfg.served_model_name}", '
            '"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}\'',
            flush=True,
        )
        print("Ctrl-C stops all.", flush=True)
        return supervise(children)
    except KeyboardInterrupt:
        print("\n[up] stopping", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as e:  # a child that would not start (its log says why)
        print(f"pdserve up: {e}", file=sys.stderr)
        return 1
    finally:
        stop_cluster(children, cfg.drain_timeout_s + STOP_MARGIN_S)
