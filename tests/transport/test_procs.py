"""The driver processes' environment: a child keeps what the parent's PYTHONPATH reaches.

On the device machine docs/gpu.md installs the carried wheels (orjson, nixl, ...) into a folder
named only by PYTHONPATH; a child started with PYTHONPATH replaced by the checkout died on
``import orjson`` before its ready line (issue 31).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.transport import procs


class _Spawned(Exception):
    """Stops spawn once the child's arguments are known (nothing is started)."""


def _spawn_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment DriverProc.spawn hands its child (the child is not started)."""
    seen: dict[str, Any] = {}

    async def fake_exec(*argv: str, **kwargs: Any) -> None:
        seen.update(kwargs, argv=argv)
        raise _Spawned

    async def spawn() -> None:
        with pytest.raises(_Spawned):
            await procs.DriverProc.spawn("sender", "prefill-0")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", fake_exec)
    asyncio.run(spawn())
    return seen["env"]


def test_a_driver_child_imports_a_module_only_the_parent_s_pythonpath_reaches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / "carried_only_here.py").write_text("VALUE = 31\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(carried), str(procs.REPO)]))
    env = _spawn_env(monkeypatch)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(procs.REPO)  # the checkout leads
    child = subprocess.run(
        [sys.executable, "-c", "import carried_only_here, tests; print(carried_only_here.VALUE)"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (child.returncode, child.stdout.strip()) == (0, "31"), child.stderr
