"""The GPU check's preflight in a simulated device image, on the CPU (issue 31's goal).

The device machine's Python has the image's packages (bench/device_image_packages.txt) and the
wheels `make gpu-wheels` carries, installed by docs/gpu.md's command into a folder named only
by ``PYTHONPATH``. Here: a venv (no pip of its own, no system site) whose site-packages holds
only the image's packages, linked from this environment's installs, and the carried wheels at
the Makefile's pins installed by that same command; ``bench/gpu_check.py --preflight`` (the
dry plan, then the import and environment checks) must pass in it, and must fail, naming the
package, where a carried wheel is left out.

What differs from the device: this machine's Python (3.11; the device's is 3.12), so the wheels
are the same pins downloaded for this interpreter (~60 MiB, cached under
~/.cache/pdserve/gpu-wheels/), and the image packages' versions are this environment's
(tests/test_gpu_packages.py checks the device's versions against the requirements).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pdserve import envs
from tests.test_gpu_packages import DEVICE_MARKERS, carried_wheels, image_packages

REPO = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "pdserve" / "gpu-wheels"
TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"

pytestmark = pytest.mark.slow


def _makefile_platforms() -> list[str]:
    line = next(ln for ln in (REPO / "Makefile").read_text().splitlines()
                if ln.startswith("GPU_PLATFORMS"))  # fmt: skip
    return re.findall(r"manylinux[\w]+", line)


def carried_wheel_files() -> list[Path]:
    """The Makefile's pins, for this interpreter, downloaded once (a marker names the pins)."""
    pins = sorted(f"{name}=={version}" for name, version in carried_wheels().items())
    where = CACHE / TAG
    marker = where / "pins.txt"
    if not (marker.is_file() and marker.read_text().split() == pins):
        platforms = [a for p in _makefile_platforms() for a in ("--platform", p)]
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", version, "--implementation", "cp", *platforms, "-d",
             str(where), *pins],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if proc.returncode != 0:
            if envs.offline():
                pytest.skip(f"PDSERVE_OFFLINE=1 and the carried wheels cannot be fetched: "
                            f"{proc.stderr[-500:]}")  # fmt: skip
            raise AssertionError(f"pip download of the carried wheels failed: {proc.stderr}")
        marker.write_text("\n".join(pins) + "\n")

    def key(name: str, version: str) -> tuple[str, str]:
        return canonicalize_name(name), version

    wanted = {key(*p.split("==")) for p in pins}
    files = [f for f in sorted(where.glob("*.whl")) if key(*f.name.split("-")[:2]) in wanted]
    assert len(files) == len(pins), files  # one wheel per pin (older pins' wheels ignored)
    return files


def _top_level_entries(dist: md.Distribution) -> set[str]:
    """The names a distribution puts in site-packages (packages, modules, .pth, dist-info)."""
    return {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}


def _image_distributions() -> list[md.Distribution]:
    """This environment's installs of the image's packages (a carried wheel replaces the
    image's), and what those installs require: a version here may need a package the image's
    version does not (this environment's huggingface-hub needs httpx2), which stands in."""
    installed = {canonicalize_name(d.metadata["Name"]): d for d in md.distributions()}
    todo = sorted((set(image_packages()) - set(carried_wheels())) & installed.keys())
    seen: dict[str, md.Distribution] = {}
    while todo:
        name = todo.pop()
        if name in seen or name in carried_wheels():
            continue
        seen[name] = installed[name]
        for line in installed[name].requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(DEVICE_MARKERS):
                dep = canonicalize_name(req.name)
                todo += [dep] if dep in installed else []
    return list(seen.values())


def simulated_image(root: Path, leave_out: set[str] = frozenset()) -> tuple[Path, Path]:
    """(python, carried site): a venv whose site-packages links only the device image's
    packages installed here, and the carried wheels (less ``leave_out``) installed with
    docs/gpu.md's command into their own folder."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(root / "venv")],
                   check=True, timeout=120)  # fmt: skip
    python = root / "venv" / "bin" / "python"
    site = next((root / "venv" / "lib").glob("python3*/site-packages"))
    here = Path(md.distribution("pip").locate_file(""))
    for dist in _image_distributions():
        for entry in _top_level_entries(dist):
            target, link = Path(dist.locate_file(entry)), site / entry
            if target.exists() and not link.exists() and target.parent == here:
                link.symlink_to(target)
    carried = root / "site"
    wheels = [str(w) for w in carried_wheel_files()
              if canonicalize_name(w.name.split("-")[0]) not in leave_out]  # fmt: skip
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--no-cache-dir", "--upgrade", "--target", str(carried), *wheels],
        check=True, timeout=300, env=_image_env(carried),
    )  # fmt: skip
    return python, carried


def _image_env(carried: Path) -> dict[str, str]:
    """docs/gpu.md's environment: PYTHONPATH is the carried site, then the checkout."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR", "LANG")}
    return {**keep, "PYTHONPATH": f"{carried}{os.pathsep}{REPO}", "PYTHONUNBUFFERED": "1"}


def _preflight(python: Path, carried: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "bench/gpu_check.py", "--preflight"], cwd=REPO, env=_image_env(carried),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_the_preflight_passes_in_a_simulated_device_image(tmp_path: Path) -> None:
    python, carried = simulated_image(tmp_path)
    no_orjson = subprocess.run([str(python), "-c", "import orjson"], capture_output=True,
                               env={"PATH": os.environ["PATH"]}, timeout=60)  # fmt: skip
    assert no_orjson.returncode != 0, "the image itself must not have the carried packages"
    proc = _preflight(python, carried)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    for check in ("checkout", "imports", "child_env", "collect"):
        assert f"preflight {check}: ok" in proc.stdout, proc.stdout


def test_the_preflight_fails_naming_a_carried_wheel_left_out(tmp_path: Path) -> None:
    python, carried = simulated_image(tmp_path, leave_out={"orjson"})
    proc = _preflight(python, carried)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = [ln for ln in proc.stdout.splitlines() if ln.startswith("[gpu_check] preflight ")]
    failed = [ln for ln in checks if not ln.endswith(": ok")]
    assert failed and all("orjson" in ln for ln in failed), failed
