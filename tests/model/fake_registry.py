"""A package registry on disk for fetch tests: wheels written here, served to the real
``pip download`` through ``PIP_NO_INDEX`` + ``PIP_FIND_LINKS`` (no network)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest


def write_wheel(into: Path, requirement: str, members: dict[str, bytes]) -> Path:
    """A minimal valid wheel of ``name==version`` holding ``members``."""
    name, version = requirement.split("==")
    dist = name.replace("-", "_")
    path = into / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        for member, data in members.items():
            z.writestr(member, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any")
        z.writestr(f"{info}/RECORD", "")
    return path


def serve_from(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """pip finds packages only in ``folder`` from now on."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
