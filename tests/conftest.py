"""Fixtures shared by every test folder: the devices this machine has.

``pytest --device-only cuda`` keeps only the tests with a parameter naming that device: the
``device`` fixture, a ``torch.device`` parameter, or a device inside a tuple parameter
(bench/gpu_check.py runs the kernel, attention, model and runner tests that way on a GPU;
tests/test_device_selection.py checks what that selects).
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


def _devices_of(value: object) -> set[str]:
    """Device types a parameter value names: a device string or torch.device, or such a value
    inside a tuple (fixtures parametrised by (backend, device) or (case, device) pairs)."""
    if isinstance(value, torch.device):
        return {value.type}
    if isinstance(value, str) and (value in ("cpu", "cuda") or value.startswith("cuda:")):
        return {torch.device(value).type}
    if isinstance(value, tuple | list):
        return set().union(*(_devices_of(v) for v in value)) if value else set()
    return set()


def item_devices(item: pytest.Item) -> set[str]:
    """The device types an item's parameters name (empty for a test that is not per-device)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return set()
    return set().union(set(), *(_devices_of(v) for v in callspec.params.values()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = config.getoption("--device-only")
    if wanted is None:
        return
    kept, dropped = [], []
    for item in items:
        (kept if wanted in item_devices(item) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
