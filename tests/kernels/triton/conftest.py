"""Run each Triton kernel test only where Triton can run on its device."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import triton as triton_kernels


@pytest.fixture(autouse=True)
def _triton_runs_on(device: str) -> None:
    # On a GPU machine the kernels compile for CUDA, so the CPU (interpreter) runs are skipped.
    if not triton_kernels.is_available(torch.device(device)):
        pytest.skip(f"Triton does not run on {device} here (no GPU, or TRITON_INTERPRET unset)")
