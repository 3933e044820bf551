"""What exists for the CPU stays off for a CUDA device: thread calibration, the CPU lease of
`pdserve up`, float32 weight copies, the C++ kernels, torch thread settings. A runner on CUDA
cannot be built here, so each decision is tested where it is made."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pdserve.kernels import cpu_gemm, elementwise, rmsnorm
from pdserve.kernels.linear import Linear
from pdserve.kernels.paged_attention import load_kernel
from pdserve.launcher import child_specs
from pdserve.launcher_args import cluster_config_from_args, parse_args
from pdserve.model_runner import ModelRunner
from pdserve.thread_tuning import should_calibrate

CUDA = torch.device("cuda")


@pytest.fixture
def two_fake_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_a_cuda_device_turns_decode_thread_calibration_off() -> None:
    assert should_calibrate("decode", "cpu", None, 8)
    assert should_calibrate("colocated", "cpu", None, 8)
    assert not should_calibrate("decode", "cuda", None, 8)
    assert not should_calibrate("prefill", "cpu", None, 8)
    assert not should_calibrate("decode", "cpu", 2, 8)
    assert not should_calibrate("decode", "cpu", None, 1)


def _worker_flags(tmp_path: Path, *argv: str) -> tuple[str | None, dict[str, list[str]]]:
    cfg = cluster_config_from_args(parse_args(["--model", str(tmp_path), *argv]))
    return cfg.cpu_lease_path, {name: args for name, args, _ in child_specs(cfg)}


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_up_on_one_gpu_has_no_cpu_lease_and_splits_the_memory(
    tmp_path: Path, two_fake_gpus: None
) -> None:
    lease, workers = _worker_flags(tmp_path, "--device", "cuda")
    assert lease is None
    for role in ("prefill", "decode"):
        assert "--cpu-lease" not in workers[role]
        assert _flag(workers[role], "--device") == "cuda"
        assert _flag(workers[role], "--gpu-memory-utilization") == "0.45"


def test_up_on_two_gpus_gives_each_worker_the_default_fraction(
    tmp_path: Path, two_fake_gpus: None
) -> None:
    _, workers = _worker_flags(tmp_path, "--prefill-device", "cuda:0", "--decode-device", "cuda:1")
    assert _flag(workers["prefill"], "--device") == "cuda:0"
    assert _flag(workers["decode"], "--device") == "cuda:1"
    assert {_flag(w, "--gpu-memory-utilization") for w in workers.values() if w[0] == "serve"} == {
        "0.9"
    }


def test_up_honours_explicit_fraction_eager_and_lease(tmp_path: Path, two_fake_gpus: None) -> None:
    lease, workers = _worker_flags(tmp_path, "--device", "cuda", "--gpu-memory-utilization",
                                   "0.3", "--enforce-eager", "--cpu-lease")  # fmt: skip
    assert lease is not None
    assert _flag(workers["decode"], "--gpu-memory-utilization") == "0.3"
    assert "--enforce-eager" in workers["prefill"] and "--enforce-eager" in workers["decode"]


def test_up_on_the_cpu_keeps_its_lease_and_sends_no_gpu_flags(tmp_path: Path) -> None:
    lease, workers = _worker_flags(tmp_path)
    assert lease is not None
    assert _flag(workers["decode"], "--device") == "cpu"
    assert "--gpu-memory-utilization" not in workers["decode"]


def test_the_cpp_kernels_never_take_device_tensors() -> None:
    x = torch.empty(4, 64, dtype=torch.bfloat16, device="meta")
    w = torch.empty(64, dtype=torch.bfloat16, device="meta")
    assert rmsnorm._kernel_for(x, w) is None
    assert elementwise._kernel_for(x) is None
    assert load_kernel(torch.bfloat16, 64, "cuda") is None
    weight = torch.empty(128, 64, dtype=torch.bfloat16, device="meta")
    assert cpu_gemm.pack_for_kernel(weight) is None
    assert Linear(weight).kernel is None


def test_runner_leaves_torch_threads_alone_on_cuda() -> None:
    before = torch.get_num_threads()
    ModelRunner._use_threads(SimpleNamespace(device=CUDA), before + 1)  # type: ignore[arg-type]
    assert torch.get_num_threads() == before
