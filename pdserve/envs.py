"""The one module that reads environment variables (PDSERVE_* and the NIXL/UCX log levels).

Everything else receives configuration through dataclasses passed down explicitly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def quiet_nixl_logs() -> None:
    """NIXL and UCX chatter at info level by default; keep errors unless the user chose a level."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")


def ucx_tls() -> str:
    """The UCX transports UCX may choose from (``UCX_TLS``), for logs: NIXL does not report
    which ones a connection picked."""
    return os.environ.get("UCX_TLS") or "unset (UCX picks among all available)"


def triton_interpreter_enabled() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels run on the CPU in its interpreter (how CPU CI
    exercises the GPU attention kernels). Triton reads the variable itself; pdserve reads it
    only to know whether its Triton backend can run on a CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def prepend_to_path(directory: str) -> None:
    """Put ``directory`` first on ``PATH``, for tools a library runs by name (torch's C++
    extension build runs ``ninja``)."""
    os.environ["PATH"] = f"{directory}{os.pathsep}{os.environ.get('PATH', '')}"


def env_with_pythonpath(first: str) -> dict[str, str]:
    """This process's environment for a child Python: ``first`` (a checkout) leads
    ``PYTHONPATH`` and the parent's entries follow, so a child still finds what only they
    reach (docs/gpu.md installs the device's carried wheels into such a folder)."""
    parts = [first, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(parts)}


def offline() -> bool:
    """``PDSERVE_OFFLINE=1``: tests that need a real model skip where it cannot be fetched
    (offline development); without it they fail, as CI (which can always fetch) must."""
    return os.environ.get("PDSERVE_OFFLINE", "0") == "1"


BOOTSTRAP_TOKEN_ENV = "PDSERVE_BOOTSTRAP_TOKEN"


def child_env(*, bootstrap_token: str) -> dict[str, str]:
    """This process's environment plus the bootstrap token, for `pdserve up`'s children."""
    return {**os.environ, BOOTSTRAP_TOKEN_ENV: bootstrap_token}


@dataclass(frozen=True)
class Env:
    log_level: str = "INFO"
    model_dir: str | None = None
    api_key: str | None = None
    # The bootstrap port's shared secret (``--bootstrap-token``); `pdserve up` hands it to its
    # workers this way so that it shows in no process list.
    bootstrap_token: str | None = None
    # OUT: where a device machine's job leaves files to bring back (bench/gpu_check.py).
    results_dir: str | None = None


def read_env() -> Env:
    return Env(
        log_level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper(),
        model_dir=os.environ.get("PDSERVE_MODEL") or None,
        api_key=os.environ.get("PDSERVE_API_KEY") or None,
        bootstrap_token=os.environ.get(BOOTSTRAP_TOKEN_ENV) or None,
        results_dir=os.environ.get("OUT") or None,
    )
