"""The GPU check's preflight: the import and environment mistakes that would stop the first
device run, found without a device (``python bench/gpu_check.py --preflight``).

A lent device machine gives minutes, and its Python has only the image's packages plus the
carried wheels (docs/gpu.md). Each check prints one line; the preflight fails if any fails:

- ``checkout``: the ``pdserve`` imported is this checkout's (``PYTHONPATH`` names it);
- ``imports``: every pdserve module, every bench module the steps run, and what the steps
  import lazily (a missing package would otherwise fail its step minutes in);
- ``child_env``: a child Python started the way the steps start theirs (the checkout first on
  ``PYTHONPATH``, the parent's entries kept) imports the carried packages from outside the
  checkout (the two-process readiness step's children once died on ``import orjson``);
- ``collect``: pytest collects the device and readiness tests without an error.

tests/test_gpu_image.py runs it in a simulated device image: a venv holding only the image's
packages, the carried wheels installed as docs/gpu.md installs them.
"""

from __future__ import annotations

import importlib
import pkgutil
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# bench modules the steps run, and what they import inside functions.
BENCH_MODULES = ("bench.gpu_plan", "bench.gpu_speed", "bench.gpu_pd", "bench.cluster",
                 "bench.serving", "bench.workloads")  # fmt: skip
LAZY_IMPORTS = ("transformers", "pdserve.model.demo")
# What the Makefile's gpu-wheels target carries, by module name.
CARRIED_MODULES = ("orjson", "nixl", "transitions", "pytest_asyncio", "llguidance", "gguf")
COLLECT_TIMEOUT_S = 300.0


def check_checkout() -> str | None:
    import pdserve  # noqa: PLC0415

    where = Path(pdserve.__file__).resolve()
    return None if where.is_relative_to(REPO) else f"pdserve comes from {where}, not {REPO}"


def check_imports() -> str | None:
    import pdserve  # noqa: PLC0415

    names = [m.name for m in pkgutil.walk_packages(pdserve.__path__, "pdserve.")]
    failed = {}
    for name in [*names, *BENCH_MODULES, *LAZY_IMPORTS]:
        if name.endswith("__main__"):
            continue  # runs the command line
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - every failure is reported, not the first
            failed[name] = repr(e)
    return f"{len(failed)} modules fail to import: {failed}" if failed else None


def check_child_env() -> str | None:
    from pdserve.envs import env_with_pythonpath  # noqa: PLC0415

    code = "import " + ", ".join(CARRIED_MODULES)
    with tempfile.TemporaryDirectory() as elsewhere:  # not the checkout: PYTHONPATH only
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env_with_pythonpath(str(REPO)), cwd=elsewhere,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    return None if proc.returncode == 0 else f"a child cannot {code!r}: {proc.stderr[-1500:]}"


def check_collect(test_paths: Sequence[str]) -> str | None:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
           *test_paths]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=COLLECT_TIMEOUT_S
    )  # fmt: skip
    if proc.returncode == 0:
        return None
    tail = proc.stdout[-2000:] + proc.stderr[-1500:]
    return f"pytest --collect-only exited {proc.returncode}: {tail}"


def preflight(test_paths: Sequence[str]) -> list[str]:
    """Run every check, print one line each; the problems found (empty: ready)."""
    import torch  # noqa: PLC0415

    print(f"[gpu_check] preflight: python {platform.python_version()}, torch {torch.__version__}"
          f", cuda {torch.version.cuda}", flush=True)  # fmt: skip
    checks: dict[str, Callable[[], str | None]] = {
        "checkout": check_checkout,
        "imports": check_imports,
        "child_env": check_child_env,
        "collect": lambda: check_collect(test_paths),
    }
    problems = []
    for name, check in checks.items():
        problem = check()
        problem = problem and " | ".join(problem.strip().splitlines())  # one line per check
        print(f"[gpu_check] preflight {name}: {problem or 'ok'}", flush=True)
        if problem:
            problems.append(f"{name}: {problem}")
    return problems
