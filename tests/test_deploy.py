"""deploy/'s Kubernetes manifests parse, and agree with the CLI: every flag a container passes
exists in its ``pdserve`` subcommand and parses, container ports are the ports the flags bind,
probes and Services name those ports, PodDisruptionBudgets and Services select real pods."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from pdserve.cli import add_serve_args
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
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc and {"apiVersion", "kind", "metadata"} <= doc.keys(), path
            docs.append(doc)
    return docs


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in load_all() if d["kind"] == kind}


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


def test_manifests_parse_and_hold_the_whole_fleet() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in load_all()}
    for name in ("pdserve-router", "pdserve-prefill", "pdserve-decode"):
        assert ("Deployment", name) in kinds
    assert ("Service", "pdserve-router") in kinds
    assert ("PodDisruptionBudget", "pdserve-prefill") in kinds
    assert ("PodDisruptionBudget", "pdserve-decode") in kinds
    assert ("ConfigMap", "pdserve-hooks") in kinds


@pytest.mark.parametrize("name", ["pdserve-router", "pdserve-prefill", "pdserve-decode"])
def test_every_flag_exists_and_container_ports_are_the_bound_ports(name: str) -> None:
    c = container(by_kind("Deployment")[name])
    command, args = parsed_args(c)
    exposed = ports(c)
    assert exposed["http"] == args.port
    assert args.host == "0.0.0.0"  # reachable from other pods
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] in ("http", args.port), probe
    if command == "serve" and args.role == "prefill":
        assert exposed["bootstrap"] == args.bootstrap_port
    if command == "serve":
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["WORKER_ROLE"] == args.role and int(env["WORKER_PORT"]) == args.port


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
    assert "/workers" in hooks["register.py"]
    drain_s = getattr(args, "drain_timeout", None) or DEFAULT_DRAIN_TIMEOUT_S
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain_s
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0  # a replacement is ready before a pod drains


def test_services_and_budgets_select_pods_that_exist_on_named_ports() -> None:
    deployments = by_kind("Deployment")
    pods = [
        (d["spec"]["template"]["metadata"]["labels"], container(d)) for d in deployments.values()
    ]
    for kind in ("Service", "PodDisruptionBudget"):
        for name, obj in by_kind(kind).items():
            selector = obj["spec"]["selector"]
            selector = selector.get("matchLabels", selector)
            matched = [c for labels, c in pods if selector.items() <= labels.items()]
            assert len(matched) == 1, f"{kind} {name} selects {len(matched)} deployments"
            if kind == "Service":
                for port in obj["spec"]["ports"]:
                    assert port["targetPort"] in ports(matched[0]), (name, port)


def test_hooks_reach_the_router_service_port() -> None:
    service = by_kind("Service")["pdserve-router"]
    [port] = service["spec"]["ports"]
    for role in ("prefill", "decode"):
        env = {
            e["name"]: e.get("value")
            for e in container(by_kind("Deployment")[f"pdserve-{role}"])["env"]
        }
        assert env["ROUTER_URL"] == f"http://pdserve-router:{port['port']}"
