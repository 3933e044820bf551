"""Fixtures shared by every test folder: the devices this machine has.

``pytest --device-only cuda`` keeps only the tests parametrised by the ``device`` fixture, on
that device (bench/gpu_check.py runs the model, kernel and runner tests that way on a GPU).
"""

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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device-only", default=None, choices=["cpu", "cuda"],
        help="run only the device-parametrised tests, on this device",
    )  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = config.getoption("--device-only")
    if wanted is None:
        return
    kept, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        on = callspec.params.get("device") if callspec is not None else None
        (kept if on == wanted else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
