"""--dtype auto takes the checkpoint's dtype; an explicit dtype wins; float16 is CUDA only."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.model.dtype import UnsupportedDtypeError, checkpoint_dtype_name, resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    ("declared", "device", "expected"),
    [
        ("float32", CPU, torch.float32),
        ("bfloat16", CPU, torch.bfloat16),
        ("float16", CUDA, torch.float16),
        ("float32", CUDA, torch.float32),
        ("torch.bfloat16", CPU, torch.bfloat16),
        ("half", CUDA, torch.float16),
    ],
)
def test_auto_runs_the_checkpoint_in_its_own_dtype(
    declared: str, device: torch.device, expected: torch.dtype
) -> None:
    assert resolve_dtype("auto", device, declared) == expected


def test_auto_runs_a_float16_checkpoint_in_bfloat16_on_cpu_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="pdserve.model.dtype"):
        assert resolve_dtype("auto", CPU, "float16") == torch.bfloat16
    assert "a float16 checkpoint runs in bfloat16 on CPU" in caplog.text


def test_auto_without_a_usable_declaration_falls_back_to_bfloat16_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="pdserve.model.dtype"):
        assert resolve_dtype("auto", CPU, None) == torch.bfloat16
        assert resolve_dtype("auto", CPU, "float8_e4m3fn") == torch.bfloat16
    assert caplog.text.count("declares no dtype") == 2


def test_an_explicit_dtype_wins_over_the_checkpoint() -> None:
    assert resolve_dtype("bfloat16", CPU, "float32") == torch.bfloat16
    assert resolve_dtype("float32", CPU, "bfloat16") == torch.float32


def test_float16_asked_for_on_cpu_and_unknown_names_are_refused() -> None:
    with pytest.raises(UnsupportedDtypeError, match="only supported on CUDA"):
        resolve_dtype("float16", CPU, "float16")
    with pytest.raises(UnsupportedDtypeError, match="unsupported dtype 'int8'"):
        resolve_dtype("int8", CPU)


def test_checkpoint_dtype_names_are_normalised() -> None:
    assert [checkpoint_dtype_name(v) for v in ("bf16", "float", "FP16", 3, None, "int4")] == [
        "bfloat16", "float32", "float16", None, None, None,
    ]  # fmt: skip
