"""Builds the layered dataclass configs of a server from parsed command-line arguments."""

from __future__ import annotations

import argparse
import json

from pdserve.api.config import ApiConfig
from pdserve.cli_common import resolve_model_dir, served_model_name
from pdserve.device import is_cpu
from pdserve.engine.config import EngineConfig, RequestDeadlines
from pdserve.engine.scheduler import SchedulerConfig
from pdserve.envs import read_env
from pdserve.fsm import RoomDeadlines
from pdserve.identity import advertise_host, default_engine_id
from pdserve.model.checkpoint import load_model_config
from pdserve.model_runner import RunnerConfig
from pdserve.parallel.mapping import check_tp_size
from pdserve.registration import RegistrationConfig
from pdserve.server import ServerConfig
from pdserve.spec.cli import speculative_config_from_args
from pdserve.tls import TLSConfig, tls_config_from_args
from pdserve.transport import FaultPlan, TransportConfig

DEFAULT_PORTS = {"prefill": 30001, "decode": 30002, "colocated": 30001}


def runner_config_from_args(args: argparse.Namespace, role: str = "colocated") -> RunnerConfig:
    """The runner flags (cli_common.add_runner_args) of a worker of ``role``, or of generate;
    ValueError for a tensor-parallel size that does not split the model."""
    tp_size = args.tensor_parallel_size
    model_dir = str(resolve_model_dir(args.model))
    if tp_size > 1:  # usage errors, before any load: a device or a size not built for
        if not is_cpu(args.device):
            raise ValueError(f"--tensor-parallel-size {tp_size}: only CPU engines split yet")
        check_tp_size(load_model_config(model_dir), tp_size)
    return RunnerConfig(
        model_dir=model_dir,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        page_size=args.page_size,
        kv_cache_bytes=args.kv_cache_mb << 20 if args.kv_cache_mb else None,
        num_pages=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_prefill_tokens=args.max_prefill_tokens,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        # generate has no --decode-threads: it measures nothing at start-up.
        decode_threads=getattr(args, "decode_threads", None),
        runs_decode_steps=role != "prefill",
        tensor_parallel_size=tp_size,
    )


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    """The batching flags (cli_common.add_runner_args) of a worker, or of generate."""
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill=args.chunked_prefill,
        prefix_caching=args.prefix_caching,
        policy=args.scheduling_policy,
    )


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    runner = runner_config_from_args(args, args.role)
    model_name = served_model_name(args.served_model_name, runner.model_dir)
    env = read_env()
    port = args.port if args.port is not None else DEFAULT_PORTS[args.role]
    advertised = advertise_host(args.host, args.advertise_host)
    engine_id = args.engine_id or default_engine_id(args.role, advertised, port)
    engine = EngineConfig(
        role=args.role,
        model_name=model_name,
        engine_id=engine_id,
        scheduler=scheduler_config_from_args(args),
        speculative=speculative_config_from_args(args),
        deadlines=RequestDeadlines(
            waiting_s=args.timeout_queue,
            prefill_progress_s=args.timeout_prefill_progress,
            waiting_for_kv_s=args.timeout_waiting_for_kv,
            prefill_inflight_s=args.timeout_transfer + args.timeout_waiting_for_input,
            request_s=args.timeout_request,
            request_base_s=args.timeout_request_base,
            request_per_token_s=args.timeout_per_token,
        ),
    )
    tls = tls_config_from_args(args)
    transport = TransportConfig(
        engine_id=engine_id,
        tls=tls,
        bootstrap_host=args.host,
        bootstrap_port=args.bootstrap_port,
        heartbeat_interval_s=args.heartbeat_interval,
        abort_quarantine_s=args.abort_quarantine,
        connect_timeout_s=args.bootstrap_connect_timeout,
        request_timeout_s=args.bootstrap_request_timeout,
        checksum=args.kv_checksum,
        bootstrap_token=args.bootstrap_token or env.bootstrap_token,
        faults=fault_plan_from_json(args.fault_plan),
        deadlines=RoomDeadlines(
            bootstrapping_s=args.timeout_bootstrap,
            waiting_for_input_s=args.timeout_waiting_for_input,
            transferring_s=args.timeout_transfer,
        ),
    )
    api_keys = tuple(args.api_key or ()) or env.api_keys
    return ServerConfig(
        runner=runner,
        engine=engine,
        transport=transport,
        api=ApiConfig(
            served_model_name=model_name,
            api_key=api_keys[0] if len(api_keys) == 1 else api_keys or None,
            admin_api_key=args.admin_api_key or env.admin_api_key,
            metrics_open=args.metrics_open,
            max_body_bytes=args.max_body_kb << 10,
            request_deadline_s=args.timeout_request,
            sse_keepalive_s=args.sse_keepalive_s,
            json_allow_extra_keys=args.json_schema_extra_keys,
            reasoning_parser=args.reasoning_parser,
            tool_call_parser=args.tool_call_parser,
        ),
        host=args.host,
        port=port,
        cpu_lease_path=args.cpu_lease,
        advertise_host=advertised,
        registration=registration_config_from_args(args, env.registration_token, tls),
        drain_timeout_s=args.drain_timeout,
        tls=tls,
    )


def registration_config_from_args(
    args: argparse.Namespace, env_token: str | None = None, tls: TLSConfig | None = None
) -> RegistrationConfig | None:
    """``--router`` and its lease flags (``env_token``: $PDSERVE_REGISTRATION_TOKEN, used
    without ``--registration-token``); None without ``--router``."""
    if not args.router:
        return None
    return RegistrationConfig(
        router_urls=tuple(args.router),
        interval_s=args.register_interval,
        ttl_s=args.register_ttl,
        token=args.registration_token or env_token,
        tls=tls or TLSConfig(),
    )


def fault_plan_from_json(text: str | None) -> FaultPlan | None:
    """``--fault-plan``: a JSON object of FaultPlan fields, or None (no faults injected).

    Raises ValueError for bad JSON, unknown fields or out-of-range values.
    """
    if text is None:
        return None
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--fault-plan is not valid JSON: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError("--fault-plan must be a JSON object of FaultPlan fields")
    try:
        return FaultPlan(**fields)
    except TypeError as e:  # an unknown field name
        raise ValueError(f"--fault-plan: {e}") from None
