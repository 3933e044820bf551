"""deploy/'s Kubernetes manifests parse, and agree with the CLI: every flag a container passes
exists in its ``pdserve`` subcommand and parses, container ports are the ports the flags bind,
probes and Services name those ports, PodDisruptionBudgets and Services select real pods,
workers register with every router replica, and the environment variables they set are the ones
pdserve/envs.py reads, from Secrets that deploy/templates/ defines."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import pdserve.envs
from pdserve.cli import add_serve_args
from pdserve.config_builder import registration_config_from_args
from pdserve.envs import BOOTSTRAP_TOKEN_ENV
from pdserve.router.cli import build_parser as router_parser

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
# Until drain (--drain-timeout) is on main, the manifests' grace periods are sized for this.
DEFAULT_DRAIN_TIMEOUT_S = 60.0


@pytest.fixture(autouse=True)
def as_on_a_gpu_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flags are parsed as on the one-GPU nodes the workers ask for (``--device cuda`` is
    checked against the machine at parse time)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def load_all() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(DEPLOY.rglob("*.yaml")):  # templates/ too
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc and {"apiVersion", "kind", "metadata"} <= doc.keys(), path
            docs.append(doc)
    return docs


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in load_all() if d["kind"] in kind.split("|")}


WORKLOADS = "Deployment|StatefulSet"


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve serve")
    add_serve_args(p)
    return p


PARSERS = {"serve": serve_parser, "router": router_parser}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    [c] = deployment["spec"]["template"]["spec"]["containers"]
    return c


def parsed_args(c: dict[str, Any]) -> tuple[str, argparse.Namespace]:
    """The container's subcommand and its args parsed by that subcommand's real parser
    (``$(VAR)`` expansions stand in as a placeholder)."""
    assert c["command"] == ["pdserve"], c["command"]
    command, *argv = [re.sub(r"\$\(\w+\)", "placeholder", a) for a in c["args"]]
    parser = PARSERS[command]()
    known = parser._option_string_actions  # every spelling the subcommand accepts
    unknown = [a.split("=")[0] for a in argv if a.startswith("--") and a.split("=")[0] not in known]
    assert not unknown, f"pdserve {command} has no {unknown}"
    try:
        return command, parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"pdserve {command} refuses {argv}")


def ports(c: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c["env"]}


def router_replica_urls() -> list[str]:
    """The URL of every router pod, by the StatefulSet's stable pod names."""
    router = by_kind("StatefulSet")["pdserve-router"]
    _, args = parsed_args(container(router))
    spec = router["spec"]
    return [
        f"http://pdserve-router-{i}.{spec['serviceName']}:{args.port}"
        for i in range(spec["replicas"])
    ]


def test_manifests_parse_and_hold_the_whole_fleet() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in load_all()}
    assert ("StatefulSet", "pdserve-router") in kinds
    for name in ("pdserve-prefill", "pdserve-decode"):
        assert ("Deployment", name) in kinds
    assert ("Service", "pdserve-router") in kinds and ("Service", "pdserve-router-peers") in kinds
    for secret in ("pdserve-api-key", "pdserve-admin-api-key", "pdserve-registration-token",
                   "pdserve-worker-keys", "pdserve-bootstrap-token"):  # fmt: skip
        assert ("Secret", secret) in kinds, secret
    assert ("PodDisruptionBudget", "pdserve-prefill") in kinds
    assert ("PodDisruptionBudget", "pdserve-decode") in kinds
    assert ("ConfigMap", "pdserve-hooks") in kinds


@pytest.mark.parametrize("name", ["pdserve-router", "pdserve-prefill", "pdserve-decode"])
def test_every_flag_exists_and_container_ports_are_the_bound_ports(name: str) -> None:
    c = container(by_kind(WORKLOADS)[name])
    command, args = parsed_args(c)
    exposed = ports(c)
    assert exposed["http"] == args.port
    assert args.host == "0.0.0.0"  # reachable from other pods
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] in ("http", args.port), probe
    if command == "serve" and args.role == "prefill":
        assert exposed["bootstrap"] == args.bootstrap_port
    if command == "serve":
        assert int(env_of(c)["WORKER_PORT"]["value"]) == args.port  # the preStop hook's


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_probe_ready_and_alive_drain_on_stop_and_ask_for_a_gpu(role: str) -> None:
    deployment = by_kind("Deployment")[f"pdserve-{role}"]
    c = container(deployment)
    _, args = parsed_args(c)
    assert args.role == role and args.device == "cuda"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"  # never a peer's health
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["python", "/hooks/drain.py"]
    hooks = by_kind("ConfigMap")["pdserve-hooks"]["data"]
    assert "/drain" in hooks["drain.py"] and '"POST"' in hooks["drain.py"]
    assert "postStart" not in c["lifecycle"] and "register.py" not in hooks  # they register
    drain_s = getattr(args, "drain_timeout", None) or DEFAULT_DRAIN_TIMEOUT_S
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain_s
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0  # a replacement is ready before a pod drains


def test_services_and_budgets_select_pods_that_exist_on_named_ports() -> None:
    deployments = by_kind(WORKLOADS)
    pods = [
        (d["spec"]["template"]["metadata"]["labels"], container(d)) for d in deployments.values()
    ]
    for kind in ("Service", "PodDisruptionBudget"):
        for name, obj in by_kind(kind).items():
            selector = obj["spec"]["selector"]
            selector = selector.get("matchLabels", selector)
            matched = [c for labels, c in pods if selector.items() <= labels.items()]
            assert len(matched) == 1, f"{kind} {name} selects {len(matched)} workloads"
            if kind == "Service":
                for port in obj["spec"]["ports"]:
                    assert port["targetPort"] in ports(matched[0]), (name, port)


def test_hooks_reach_the_router_service_port() -> None:
    service = by_kind("Service")["pdserve-router"]
    [port] = service["spec"]["ports"]
    for role in ("prefill", "decode"):
        env = {
            e["name"]: e.get("value")
            for e in container(by_kind(WORKLOADS)[f"pdserve-{role}"])["env"]
        }
        assert env["ROUTER_URL"] == f"http://pdserve-router:{port['port']}"


def test_routers_run_several_replicas_each_with_a_dns_name_before_it_is_ready() -> None:
    router = by_kind("StatefulSet")["pdserve-router"]
    assert router["spec"]["replicas"] >= 2  # soft state: every replica learns every worker
    _, args = parsed_args(container(router))
    assert not (args.prefill or args.decode or args.worker)  # no static worker list
    peers = by_kind("Service")[router["spec"]["serviceName"]]["spec"]
    # Headless, and published unready: a router is ready only once workers registered with it.
    assert peers["clusterIP"] == "None" and peers["publishNotReadyAddresses"] is True


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_register_with_every_router_replica_at_their_pod_ip(role: str) -> None:
    c = container(by_kind("Deployment")[f"pdserve-{role}"])
    _, args = parsed_args(c)
    assert args.router == router_replica_urls()
    assert "--advertise-host=$(POD_IP)" in c["args"] and args.host == "0.0.0.0"
    assert env_of(c)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    registration = registration_config_from_args(args, env_token="token")
    assert registration is not None and registration.ttl_s > registration.interval_s


@pytest.mark.parametrize("name", ["pdserve-router", "pdserve-prefill", "pdserve-decode"])
def test_environment_names_are_read_by_pdserve_and_secrets_exist(name: str) -> None:
    c = container(by_kind(WORKLOADS)[name])
    read = Path(pdserve.envs.__file__).read_text()
    secrets = by_kind("Secret")
    for var, entry in env_of(c).items():
        if var.startswith("PDSERVE_"):
            assert f'"{var}"' in read, f"pdserve/envs.py reads no {var}"
        ref = entry.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert ref["key"] in secrets[ref["name"]]["stringData"], (var, ref)
    if name != "pdserve-router":  # both roles: prefills check the token, decodes send it
        ref = env_of(c)[BOOTSTRAP_TOKEN_ENV]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "pdserve-bootstrap-token", "key": "token"}


def test_routers_stay_ready_on_the_decode_fallback_and_route_by_prefix() -> None:
    c = container(by_kind("StatefulSet")["pdserve-router"])
    _, args = parsed_args(c)
    assert c["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    # A fleet that lost every prefill keeps its routers in rotation: the decodes serve.
    assert args.readiness == "serving" and not args.enforce_disagg
    assert args.policy == "cache_aware"  # several prefills: prefix affinity (benchmarks.md)


# Which secret (name, key) each credential variable of each workload comes from: least
# privilege, one secret per credential; workers hold no key of the router but the token.
CREDENTIALS = {
    "pdserve-router": {
        "PDSERVE_API_KEY": ("pdserve-api-key", "key"),
        "PDSERVE_ADMIN_API_KEY": ("pdserve-admin-api-key", "key"),
        "PDSERVE_REGISTRATION_TOKEN": ("pdserve-registration-token", "token"),
        "PDSERVE_WORKER_API_KEY": ("pdserve-worker-keys", "client"),
    },
    **{
        f"pdserve-{role}": {
            "PDSERVE_API_KEY": ("pdserve-worker-keys", "client"),
            "PDSERVE_ADMIN_API_KEY": ("pdserve-worker-keys", "admin"),
            "PDSERVE_REGISTRATION_TOKEN": ("pdserve-registration-token", "token"),
        }
        for role in ("prefill", "decode")
    },
}


@pytest.mark.parametrize("name", sorted(CREDENTIALS))
def test_each_workload_holds_exactly_its_own_credentials(name: str) -> None:
    env = env_of(container(by_kind(WORKLOADS)[name]))
    held = {
        var: (entry["valueFrom"]["secretKeyRef"]["name"], entry["valueFrom"]["secretKeyRef"]["key"])
        for var, entry in env.items()
        if var in pdserve.envs.SECRET_ENVS
    }
    assert held == CREDENTIALS[name]
    if name != "pdserve-router":
        router_only = {("pdserve-api-key", "key"), ("pdserve-admin-api-key", "key")}
        assert not router_only & set(held.values())


def test_router_vets_registrations_and_the_drain_hook_uses_token_and_admin_key() -> None:
    _, args = parsed_args(container(by_kind("StatefulSet")["pdserve-router"]))
    assert args.worker_allow and args.served_model_name == "model"
    for role in ("prefill", "decode"):
        _, worker = parsed_args(container(by_kind("Deployment")[f"pdserve-{role}"]))
        assert worker.served_model_name == args.served_model_name
    hook = by_kind("ConfigMap")["pdserve-hooks"]["data"]["drain.py"]
    assert "/workers/deregister" in hook and "PDSERVE_REGISTRATION_TOKEN" in hook
    assert "/drain" in hook and "PDSERVE_ADMIN_API_KEY" in hook
    assert "PDSERVE_API_KEY'" not in hook  # a client key opens neither
    compile(hook, "drain.py", "exec")
