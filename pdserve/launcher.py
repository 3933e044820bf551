"""`pdserve up`: a local PD cluster (prefills + decodes + router) as child processes on 127.0.0.1.

With ``--num-prefill N`` / ``--num-decode N`` the i-th worker of a role (from 0) listens on its
role's port + ``PORT_STRIDE * i`` (30001, 30011, ... and 30002, 30012, ...) and a prefill's
bootstrap port is ``--bootstrap-port`` + i.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from pdserve.cli_common import add_model_args, resolve_model_dir, served_model_name
from pdserve.device import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    add_device_args,
    device_arg,
    is_cpu,
    same_physical_device,
)
from pdserve.envs import child_env, read_env
from pdserve.lifetime import parent_death_preexec
from pdserve.model.checkpoint import check_model_config
from pdserve.model.config import ModelDirError
from pdserve.router.config import POLICY_NAMES


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
    prefill_args: tuple[str, ...] = ()  # the prefill worker only (its device)
    decode_args: tuple[str, ...] = ()  # the decode worker only
    # Both workers share this machine's cores: their model steps take turns (engine/cpu_lease.py).
    cpu_lease_path: str | None = None
    # The shared secret of the bootstrap port, new for each cluster; the workers get it in
    # their environment (PDSERVE_BOOTSTRAP_TOKEN), not on a command line others can read.
    bootstrap_token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    # The workers' client key, new for each cluster: only the router holds it (as its
    # --worker-api-key), so clients reach the workers only through the router.
    worker_api_key: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    api_key: str | None = field(default=None, repr=False)  # the user's client key (router)
    admin_api_key: str | None = field(default=None, repr=False)  # every child's, if given
    # Stopping (SIGTERM/Ctrl-C) drains every child this long before it is killed (STOP_MARGIN_S
    # more: a drained child still has to exit).
    drain_timeout_s: float = 30.0
    num_prefill: int = 1
    num_decode: int = 1
    policy: str | None = None  # the router's --policy; None: the router's default

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("--num-prefill and --num-decode must be >= 1")
        ports = [self.router_port, *self.prefill_ports, *self.decode_ports]
        ports += self.bootstrap_ports
        if len(set(ports)) != len(ports):
            raise ValueError(f"two children would share a port: {sorted(ports)}")

    @property
    def prefill_ports(self) -> list[int]:
        return [self.prefill_port + PORT_STRIDE * i for i in range(self.num_prefill)]

    @property
    def decode_ports(self) -> list[int]:
        return [self.decode_port + PORT_STRIDE * i for i in range(self.num_decode)]

    @property
    def bootstrap_ports(self) -> list[int]:
        return [self.bootstrap_port + i for i in range(self.num_prefill)]


STOP_MARGIN_S = 10.0
PORT_STRIDE = 10  # between two workers of one role
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
            url = f"http://{host}:{port}"
            specs.append((name, argv, url))
            router += [f"--{role}", url]
    return [*specs, ("router", router, f"http://{host}:{cfg.router_port}")]


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


def is_ready(url: str, path: str = "/health/ready") -> bool:
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=2) as resp:
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
            if is_ready(child.url, READY_PATHS.get(child.name, "/health/ready")):
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


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve up", description=__doc__)
    add_model_args(p)
    p.add_argument("--router-port", type=int, default=30000)
    p.add_argument("--prefill-port", type=int, default=30001)
    p.add_argument("--decode-port", type=int, default=30002)
    p.add_argument("--bootstrap-port", type=int, default=8998)
    p.add_argument(
        "--num-prefill", type=int, default=1, metavar="N",
        help=f"prefill workers (the i-th on --prefill-port + {PORT_STRIDE}*i, bootstrap port + i)",
    )  # fmt: skip
    p.add_argument(
        "--num-decode", type=int, default=1, metavar="N",
        help=f"decode workers (the i-th on --decode-port + {PORT_STRIDE}*i)",
    )  # fmt: skip
    p.add_argument(
        "--policy", choices=POLICY_NAMES, default=None,
        help="the router's routing policy (default: the router's)",
    )  # fmt: skip
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument(
        "--api-key", default=None, metavar="KEY",
        help="clients' key at the router ($PDSERVE_API_KEY); the workers get a key of their "
        "own, made for this cluster",
    )  # fmt: skip
    p.add_argument(
        "--admin-api-key", default=None, metavar="KEY",
        help="every child's admin key ($PDSERVE_ADMIN_API_KEY); without it admin endpoints "
        "answer only on loopback, where the cluster listens",
    )  # fmt: skip
    p.add_argument(
        "--drain-timeout", type=float, default=30.0,
        help="on SIGTERM/Ctrl-C every child drains this long (requests in flight finish) "
        "before it is killed",
    )  # fmt: skip
    add_device_args(p, utilization_default=None)
    p.add_argument("--prefill-device", type=device_arg, default=None, help="default: --device")
    p.add_argument("--decode-device", type=device_arg, default=None, help="default: --device")
    p.add_argument(
        "--cpu-lease", action=argparse.BooleanOptionalAction, default=None,
        help="the two workers take turns at this machine's cores for model steps, each with all "
        "its threads (off: they compute at once; then split the cores with --num-threads); "
        "default: on when both workers run on the CPU",
    )  # fmt: skip
    return p.parse_args(argv)


def worker_args(args: argparse.Namespace) -> list[str]:
    """Every model/engine flag of `pdserve up`, passed on to both workers."""
    out = ["--dtype", args.dtype, "--page-size", str(args.page_size),
           "--max-num-seqs", str(args.max_num_seqs),
           "--max-prefill-tokens", str(args.max_prefill_tokens)]  # fmt: skip
    out += [] if args.chunked_prefill else ["--no-chunked-prefill"]
    out += [] if args.prefix_caching else ["--no-prefix-caching"]
    optional = {
        "--kv-cache-mb": args.kv_cache_mb,  # None: each worker sizes its own (CPU or CUDA)
        "--num-gpu-blocks": args.num_gpu_blocks,
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
    prefill_device = args.prefill_device or args.device
    decode_device = args.decode_device or args.device
    on_cpu = is_cpu(prefill_device) and is_cpu(decode_device)
    use_lease = on_cpu if args.cpu_lease is None else args.cpu_lease
    env = read_env()
    return ClusterConfig(
        api_key=args.api_key or env.api_key,
        admin_api_key=args.admin_api_key or env.admin_api_key,
        model_dir=model_dir,
        served_model_name=served_model_name(args.served_model_name, model_dir),
        router_port=args.router_port,
        prefill_port=args.prefill_port,
        decode_port=args.decode_port,
        bootstrap_port=args.bootstrap_port,
        ready_timeout_s=args.ready_timeout,
        extra_worker_args=tuple(worker_args(args)),
        prefill_args=role_device_args(args, prefill_device, decode_device),
        decode_args=role_device_args(args, decode_device, prefill_device),
        cpu_lease_path=default_lease_path(args.router_port) if use_lease else None,
        drain_timeout_s=args.drain_timeout,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        policy=args.policy,
    )


def role_device_args(args: argparse.Namespace, device: str, peer_device: str) -> tuple[str, ...]:
    """One worker's device flags. Two workers on one GPU split it: half the default memory
    fraction each unless --gpu-memory-utilization says otherwise (a fraction of the device per
    worker)."""
    out = ["--device", device]
    if not is_cpu(device):
        utilization = args.gpu_memory_utilization
        if utilization is None:
            shared = same_physical_device(device, peer_device)
            utilization = DEFAULT_GPU_MEMORY_UTILIZATION / (2 if shared else 1)
        out += ["--gpu-memory-utilization", str(utilization)]
    if args.enforce_eager:
        out.append("--enforce-eager")
    return tuple(out)


def default_lease_path(router_port: int) -> str:
    """One lease per user and cluster (its router port), kept across worker restarts."""
    name = f"pdserve-up-{os.getuid()}-{router_port}.cpu-lease"
    return os.path.join(tempfile.gettempdir(), name)


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
        wait_ready(children, cfg.ready_timeout_s)
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
