"""Device as configuration: values checked once, with the flag or field named."""

from __future__ import annotations

import argparse
import threading

import pytest
import torch

from pdserve.device import (
    add_device_args,
    bind_device,
    check_device,
    check_gpu_memory_utilization,
    is_cpu,
    same_physical_device,
)


@pytest.fixture
def two_fake_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """What check_device asks of torch, answered as on a machine with two GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_cpu_is_always_accepted() -> None:
    assert check_device("cpu") == torch.device("cpu")
    assert is_cpu("cpu") and not is_cpu("cuda:1")


@pytest.mark.parametrize("value", ["tpu", "", "cuda:x", "mps", "cpu:3"])
def test_an_unknown_device_names_the_source(value: str) -> None:
    with pytest.raises(ValueError, match=r"RunnerConfig\.device=.*expected cpu, cuda or cuda:N"):
        check_device(value, "RunnerConfig.device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused_naming_the_flag() -> None:
    p = argparse.ArgumentParser()
    add_device_args(p, 0.9)
    with pytest.raises(SystemExit):
        p.parse_args(["--device", "cuda"])
    with pytest.raises(ValueError, match="--device='cuda': CUDA is not available"):
        check_device("cuda", "--device")


def test_a_cuda_index_past_the_device_count_is_refused(two_fake_gpus: None) -> None:
    assert check_device("cuda:1") == torch.device("cuda:1")
    assert check_device("cuda") == torch.device("cuda")
    with pytest.raises(ValueError, match="has 2 CUDA device"):
        check_device("cuda:2", "--decode-device")


def test_device_flags_parse_and_default(two_fake_gpus: None) -> None:
    p = argparse.ArgumentParser()
    add_device_args(p, 0.9)
    args = p.parse_args([])
    assert (args.device, args.gpu_memory_utilization, args.enforce_eager) == ("cpu", 0.9, False)
    args = p.parse_args(["--device", "cuda:1", "--gpu-memory-utilization", "0.45",
                         "--enforce-eager", "--num-gpu-blocks", "100"])  # fmt: skip
    assert (args.device, args.gpu_memory_utilization) == ("cuda:1", 0.45)
    assert args.enforce_eager and args.num_gpu_blocks == 100


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01])
def test_memory_utilization_is_a_fraction(value: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        check_gpu_memory_utilization(value)
    assert check_gpu_memory_utilization(1.0) == 1.0


def test_cuda_and_cuda_0_are_one_device() -> None:
    assert same_physical_device("cuda", "cuda:0")
    assert not same_physical_device("cuda:0", "cuda:1")
    assert not same_physical_device("cpu", "cuda")
    assert same_physical_device("cpu", "cpu")


class _ThreadDevices:
    """CUDA's current device, per host thread, as the runtime keeps it (device 0 by default)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._local = threading.local()
        self.set_calls: list[int] = []
        monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(self._local, "i", 0))
        monkeypatch.setattr(torch.cuda, "set_device", self._set)

    def _set(self, device: torch.device) -> None:
        self.set_calls.append(device.index)
        self._local.i = device.index

    def current(self) -> int:
        return getattr(self._local, "i", 0)


def test_bind_device_sets_the_calling_threads_device_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    devices = _ThreadDevices(monkeypatch)
    bind_device("cuda:1")
    bind_device("cuda:1")  # already current: no second call
    assert devices.current() == 1 and devices.set_calls == [1]
    seen: list[int] = []
    other = threading.Thread(target=lambda: seen.append(devices.current()))
    other.start()
    other.join(5)
    assert seen == [0], "a new thread starts on device 0: each thread must bind its own"
    bind_device("cpu")
    bind_device("cuda")  # the current device, whatever it is
    assert devices.set_calls == [1]
