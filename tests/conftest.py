"""Fixtures every test package shares."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter. Triton reads this when a kernel is
# decorated, so it is set before any test imports one (conftest runs first).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Every device this machine has: "cpu" always, "cuda" where a GPU is present."""
    return request.param
