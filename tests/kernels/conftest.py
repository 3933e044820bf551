"""The C++ CPU kernels as a fixture: loaded (and built, the first time on a machine) when a test
that needs them runs, never while tests are collected. ``pytest --device-only cuda`` on a GPU
machine then deselects these tests without compiling anything (issue 22: the build took minutes
of a short device lease)."""

from __future__ import annotations

import types

import pytest

from pdserve.kernels import cpu_ext


@pytest.fixture
def cpu_kernels() -> types.ModuleType:
    module = cpu_ext.load()
    if module is None:
        pytest.skip("kernel needs AVX2 and a C++ compiler")
    return module
