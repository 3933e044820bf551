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
API_KEY_ENV = "PDSERVE_API_KEY"
ADMIN_API_KEY_ENV = "PDSERVE_ADMIN_API_KEY"
REGISTRATION_TOKEN_ENV = "PDSERVE_REGISTRATION_TOKEN"
WORKER_API_KEY_ENV = "PDSERVE_WORKER_API_KEY"
SECRET_ENVS = (API_KEY_ENV, ADMIN_API_KEY_ENV, REGISTRATION_TOKEN_ENV, WORKER_API_KEY_ENV)


def child_env(*, bootstrap_token: str, **secrets: str | None) -> dict[str, str]:
    """This process's environment, less its own access secrets, plus the bootstrap token and
    ``secrets`` (env name -> value; None leaves it unset), for `pdserve up`'s children."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENVS}
    env[BOOTSTRAP_TOKEN_ENV] = bootstrap_token
    env.update({k: v for k, v in secrets.items() if v})
    return env


@dataclass(frozen=True)
class Env:
    """What pdserve reads of its environment (``read_env``)."""

    log_level: str = "INFO"
    model_dir: str | None = None
    api_key: str | None = None  # PDSERVE_API_KEY as given (one key, or several comma-separated)
    # Access secrets (pdserve/auth.py), here so that they show in no process list.
    admin_api_key: str | None = None
    registration_token: str | None = None
    worker_api_key: str | None = None  # a router's key for its workers
    # The bootstrap port's shared secret (``--bootstrap-token``); `pdserve up` hands it to its
    # workers this way so that it shows in no process list.
    bootstrap_token: str | None = None
    # OUT: where a device machine's job leaves files to bring back (bench/gpu_check.py).
    results_dir: str | None = None

    @property
    def api_keys(self) -> tuple[str, ...]:
        """PDSERVE_API_KEY as a tuple of keys (comma-separated: one per client)."""
        return tuple(k.strip() for k in (self.api_key or "").split(",") if k.strip())


def read_env() -> Env:
    return Env(
        log_level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper(),
        model_dir=os.environ.get("PDSERVE_MODEL") or None,
        api_key=os.environ.get(API_KEY_ENV) or None,
        admin_api_key=os.environ.get(ADMIN_API_KEY_ENV) or None,
        registration_token=os.environ.get(REGISTRATION_TOKEN_ENV) or None,
        worker_api_key=os.environ.get(WORKER_API_KEY_ENV) or None,
        bootstrap_token=os.environ.get(BOOTSTRAP_TOKEN_ENV) or None,
        results_dir=os.environ.get("OUT") or None,
    )
