"""pdserve serve flags: the GIL switch interval, and transport timings reaching the config."""

from __future__ import annotations

import argparse
import sys

import pytest

from pdserve.cli import DEFAULT_GIL_SWITCH_INTERVAL_MS, add_serve_args, apply_gil_switch_interval
from pdserve.config_builder import server_config_from_args


@pytest.fixture
def restore_switch_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


def test_serve_defaults_to_a_short_gil_switch_interval(restore_switch_interval: None) -> None:
    args = parse()
    assert args.gil_switch_interval_ms == DEFAULT_GIL_SWITCH_INTERVAL_MS < 5.0
    apply_gil_switch_interval(args.gil_switch_interval_ms)
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_GIL_SWITCH_INTERVAL_MS / 1000)


def test_zero_keeps_the_interpreter_default(restore_switch_interval: None) -> None:
    sys.setswitchinterval(0.005)
    apply_gil_switch_interval(parse("--gil-switch-interval-ms", "0").gil_switch_interval_ms)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_transport_timings_are_flags_that_reach_the_transport_config(tmp_path) -> None:
    args = parse(
        "--model", str(tmp_path), "--abort-quarantine", "0.5",
        "--bootstrap-connect-timeout", "0.25", "--bootstrap-request-timeout", "1.5",
    )  # fmt: skip
    transport = server_config_from_args(args).transport
    assert (transport.abort_quarantine_s, transport.connect_timeout_s) == (0.5, 0.25)
    assert transport.request_timeout_s == 1.5


def test_a_non_positive_bootstrap_timeout_is_a_usage_error(tmp_path) -> None:
    args = parse("--model", str(tmp_path), "--bootstrap-connect-timeout", "0")
    with pytest.raises(ValueError, match="connect_timeout_s"):
        server_config_from_args(args)


def test_decode_threads_default_to_auto_and_a_count_reaches_the_runner_config(tmp_path) -> None:
    auto = server_config_from_args(parse("--model", str(tmp_path)))
    assert auto.runner.decode_threads is None  # measured at start-up
    args = parse("--model", str(tmp_path), "--num-threads", "2", "--decode-threads", "1")
    runner = server_config_from_args(args).runner
    assert (runner.num_threads, runner.decode_threads) == (2, 1)
    assert parse("--decode-threads", "auto").decode_threads is None


@pytest.mark.parametrize(("role", "prefills"), [("decode", False), ("prefill", True),
                                               ("colocated", True)])  # fmt: skip
def test_only_the_decode_role_is_told_it_never_prefills_prompts(
    tmp_path, role: str, prefills: bool
) -> None:
    runner = server_config_from_args(parse("--model", str(tmp_path), "--role", role)).runner
    assert runner.prefills_prompts is prefills


@pytest.mark.parametrize("value", ["0", "-1", "many"])
def test_decode_threads_must_be_auto_or_a_positive_count(value: str) -> None:
    with pytest.raises(SystemExit):
        parse("--decode-threads", value)


def test_device_flags_reach_the_runner_config(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    default = server_config_from_args(parse("--model", str(tmp_path))).runner
    assert (default.device, default.gpu_memory_utilization, default.enforce_eager) == (
        "cpu", 0.9, False
    )  # fmt: skip
    assert default.kv_cache_bytes is None and default.num_pages is None  # sized by the runner
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    args = parse("--model", str(tmp_path), "--device", "cuda:0", "--gpu-memory-utilization",
                 "0.5", "--enforce-eager", "--num-gpu-blocks", "300",
                 "--kv-cache-mb", "64")  # fmt: skip
    runner = server_config_from_args(args).runner
    assert (runner.device, runner.gpu_memory_utilization, runner.enforce_eager) == (
        "cuda:0", 0.5, True
    )  # fmt: skip
    assert (runner.num_pages, runner.kv_cache_bytes) == (300, 64 << 20)
