"""The NIXL wheel is chosen from torch's CUDA version."""

from __future__ import annotations

import pytest

from pdserve.transport.nixl_compat import nixl_agent, nixl_module_order


@pytest.mark.parametrize(
    "torch_cuda, first",
    [("13.0", "nixl_cu13"), ("13.2", "nixl_cu13"), ("12.8", "nixl_cu12"), ("12.4", "nixl_cu12")],
)
def test_a_cuda_torch_prefers_the_matching_wheel(torch_cuda: str, first: str) -> None:
    order = nixl_module_order(torch_cuda)
    assert order[0] == first and order[-1] == "nixl"
    assert sorted(order[:2]) == ["nixl_cu12", "nixl_cu13"]


def test_a_cpu_torch_takes_whichever_variant_is_installed() -> None:
    assert nixl_module_order(None) == ("nixl_cu12", "nixl_cu13", "nixl")


def test_an_unknown_cuda_major_still_finds_a_wheel() -> None:
    assert nixl_module_order("14.0") == ("nixl_cu12", "nixl_cu13", "nixl")


def test_the_shim_exposes_an_agent_class() -> None:
    assert nixl_agent.__name__ == "nixl_agent"
