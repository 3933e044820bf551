"""Which GGML tensor types load: the supported list, and any other type refused at load by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from pdserve.kernels.quant_gemm import SUPPORTED_TYPES
from pdserve.model.checkpoint import load_model_config
from pdserve.model.config import ModelDirError
from pdserve.model.gguf.config import SUPPORTED_GGML_TYPES
from tests.model.gguf.conftest import demo_gguf


def test_the_types_a_gguf_file_may_hold_are_those_the_quantized_matmul_runs() -> None:
    assert set(SUPPORTED_GGML_TYPES) == SUPPORTED_TYPES, (
        "a type the kernel gains (or loses) belongs in pdserve.model.gguf.config too"
    )


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "IQ4_XS", "IQ4_NL", "Q8_1"])
def test_a_file_with_a_type_pdserve_cannot_run_is_refused_naming_tensor_and_type(
    kind: str, demo_dir: Path, tmp_path: Path
) -> None:
    # Raw blocks of the type's size (gguf has no quantizer for most of these): refused from the
    # tensor table, before any value is read.
    types = {"ffn_down.weight": GGMLQuantizationType[kind]}
    path = demo_gguf(demo_dir, tmp_path, "Q8_0", types=types)
    with pytest.raises(ModelDirError) as refused:
        load_model_config(path)
    message = str(refused.value)
    assert f"'blk.0.ffn_down.weight' is stored as {kind}" in message
    assert "supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K" in message


def test_pdserve_up_refuses_such_a_file_before_starting_any_worker(
    demo_dir: Path, tmp_path: Path
) -> None:
    path = demo_gguf(demo_dir, tmp_path, "Q8_0", types={"attn_q.weight": GGMLQuantizationType.Q2_K})
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "up", "--model", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "'blk.0.attn_q.weight' is stored as Q2_K" in done.stderr
