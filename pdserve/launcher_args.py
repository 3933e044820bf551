"""`pdserve up`'s flags and the cluster they describe: ports, the workers' shared flags, each
role's device flags, the secrets made for one cluster (the processes: pdserve/launcher.py)."""

from __future__ import annotations

import argparse
import os
import secrets
import tempfile
from dataclasses import dataclass, field

from pdserve.cli_common import (
    TOOL_PARSER_CHOICES,
    add_model_args,
    resolve_model_dir,
    served_model_name,
    tp_size_arg,
)
from pdserve.device import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    add_device_args,
    device_arg,
    is_cpu,
    same_physical_device,
)
from pdserve.envs import read_env
from pdserve.reasoning.parser import PARSERS
from pdserve.router.config import POLICY_NAMES
from pdserve.spec.cli import add_speculative_args, speculative_worker_args
from pdserve.tls import TLSConfig, add_tls_args, tls_config_from_args

PORT_STRIDE = 10  # between two workers of one role


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
    tls: TLSConfig = field(default_factory=TLSConfig)  # --ssl-*: passed to every child

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


def parse_args(argv: list[str]) -> argparse.Namespace:
    about = "a local PD cluster (prefills + decodes + router) as child processes on 127.0.0.1"
    p = argparse.ArgumentParser(prog="pdserve up", description=about)
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
    p.add_argument(
        "--reasoning-parser", default=None, choices=sorted(PARSERS),
        help="both workers split a thinking model's <think> block off its answer "
        "(pdserve serve --reasoning-parser)",
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
        "--tool-call-parser", default="auto", choices=TOOL_PARSER_CHOICES,
        help="the workers' --tool-call-parser (auto: from the chat template)",
    )  # fmt: skip
    p.add_argument(
        "--drain-timeout", type=float, default=30.0,
        help="on SIGTERM/Ctrl-C every child drains this long (requests in flight finish) "
        "before it is killed",
    )  # fmt: skip
    add_device_args(p, utilization_default=None)
    add_tls_args(p)
    add_speculative_args(p)
    p.add_argument("--prefill-device", type=device_arg, default=None, help="default: --device")
    p.add_argument("--decode-device", type=device_arg, default=None, help="default: --device")
    p.add_argument(
        "--prefill-tp", type=tp_size_arg, default=None, metavar="M",
        help="the prefill workers' --tensor-parallel-size (default: --tensor-parallel-size)",
    )  # fmt: skip
    p.add_argument(
        "--decode-tp", type=tp_size_arg, default=None, metavar="N",
        help="the decode workers' --tensor-parallel-size (default: --tensor-parallel-size); "
        "KV moves between any two sizes (every engine's pages are the TP1 pages)",
    )  # fmt: skip
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
           "--max-prefill-tokens", str(args.max_prefill_tokens),
           "--scheduling-policy", args.scheduling_policy]  # fmt: skip
    out += [] if args.chunked_prefill else ["--no-chunked-prefill"]
    out += [] if args.prefix_caching else ["--no-prefix-caching"]
    if args.tool_call_parser != "auto":
        out += ["--tool-call-parser", args.tool_call_parser]
    optional = {
        "--kv-cache-mb": args.kv_cache_mb,  # None: each worker sizes its own (CPU or CUDA)
        "--num-gpu-blocks": args.num_gpu_blocks,
        "--max-model-len": args.max_model_len,
        "--num-threads": args.num_threads,
        "--decode-threads": args.decode_threads,  # None is auto, the workers' default
        "--reasoning-parser": args.reasoning_parser,
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
        prefill_args=role_device_args(args, prefill_device, decode_device)
        + ("-tp", str(args.prefill_tp or args.tensor_parallel_size)),
        decode_args=role_device_args(args, decode_device, prefill_device)
        + ("-tp", str(args.decode_tp or args.tensor_parallel_size))
        + tuple(speculative_worker_args(args)),
        cpu_lease_path=default_lease_path(args.router_port) if use_lease else None,
        drain_timeout_s=args.drain_timeout,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        policy=args.policy,
        tls=tls_config_from_args(args),
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
