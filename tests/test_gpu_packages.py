"""The device machine has no network: what it lacks travels as wheels (``make gpu-wheels``).

The wheels plus the device image's packages (bench/device_image_packages.txt) must cover every
runtime requirement in setup.cfg, the wheels' own requirements, and every third-party import of
the code bench/gpu_check.py runs there; otherwise the check dies on an ImportError on a machine
that is lent for minutes (issue 22: llguidance was missing).
"""

from __future__ import annotations

import ast
import configparser
import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
# The device machine's interpreter (KINDS.md: Python 3.12.3 on x86-64 Linux).
DEVICE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3",
                  "sys_platform": "linux", "platform_system": "Linux",
                  "platform_machine": "x86_64", "implementation_name": "cpython",
                  "platform_python_implementation": "CPython", "extra": ""}  # fmt: skip
# The nixl meta package names both CUDA builds; it imports the one for the machine's CUDA major
# (the image's torch is +cu130), so nixl-cu13 alone is carried.
NOT_NEEDED = {("nixl", "nixl-cu12")}
# Imported only on paths the check never takes (and not in setup.cfg's requirements).
OPTIONAL_IMPORTS: set[str] = set()
# What bench/gpu_check.py runs on the device: the package, its bench modules, the tests it names.
DEVICE_CODE = ("pdserve", "bench/gpu_check.py", "bench/gpu_plan.py", "bench/gpu_speed.py",
               "bench/gpu_preflight.py",
               "bench/gpu_pd.py", "bench/cluster.py", "bench/serving.py", "bench/workloads.py",
               "tests/conftest.py", "tests/kernels", "tests/attention", "tests/model",
               "tests/test_model_runner.py", "tests/transport")  # fmt: skip


def carried_wheels() -> dict[str, Version]:
    """name -> version of every wheel the Makefile's gpu-wheels target downloads."""
    makefile = (REPO / "Makefile").read_text()
    line = next(ln for ln in makefile.splitlines() if "pip download" in ln and "GPU_WHEELS" in ln)
    return {canonicalize_name(n): Version(v) for n, v in re.findall(r"([\w.-]+)==([\w.]+)", line)}


def image_packages() -> dict[str, Version | None]:
    out: dict[str, Version | None] = {}
    for line in (REPO / "bench" / "device_image_packages.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = Version(version) if version else None
    return out


def device_packages() -> dict[str, Version | None]:
    return {**image_packages(), **carried_wheels()}  # a carried wheel replaces the image's


def runtime_requirements() -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options"]["install_requires"].strip().splitlines()
    reqs = [Requirement(ln.split("#")[0].strip()) for ln in lines if ln.split("#")[0].strip()]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(DEVICE_MARKERS)]


def uncovered(reqs: list[Requirement], have: dict[str, Version | None]) -> list[str]:
    missing = []
    for req in reqs:
        name = canonicalize_name(req.name)
        if name not in have:
            missing.append(f"{req}: not on the device")
        elif have[name] is not None and not req.specifier.contains(have[name], prereleases=True):
            missing.append(f"{req}: the device has {have[name]}")
    return missing


def test_carried_wheels_and_the_device_image_cover_every_runtime_requirement() -> None:
    reqs = runtime_requirements()
    assert any(canonicalize_name(r.name) == "llguidance" for r in reqs)
    assert uncovered(reqs, device_packages()) == []


def test_the_carried_wheels_own_requirements_are_on_the_device_too() -> None:
    have = device_packages()
    missing = []
    for wheel in carried_wheels():
        for line in md.requires(wheel) or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(DEVICE_MARKERS):
                continue
            if (wheel, canonicalize_name(req.name)) not in NOT_NEEDED:
                missing += [f"{wheel} -> {m}" for m in uncovered([req], have)]
    assert missing == []


def _top_level_imports(path: Path) -> set[str]:
    """Modules imported anywhere in ``path`` (lazy imports inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_third_party_import_of_the_code_the_check_runs_is_on_the_device() -> None:
    files = []
    for entry in DEVICE_CODE:
        path = REPO / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    imports = set().union(*(_top_level_imports(f) for f in files))
    local = {"pdserve", "bench", "tests", "pdserve_cpu_ext"}
    third_party = sorted(imports - set(sys.stdlib_module_names) - local - OPTIONAL_IMPORTS)
    dists = md.packages_distributions()
    have = device_packages()
    missing = {}
    for module in third_party:
        owners = {canonicalize_name(d) for d in dists.get(module, [])}
        if not owners & have.keys():
            missing[module] = sorted(owners) or "not installed here either"
    assert missing == {}
