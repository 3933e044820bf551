"""Command-line flags: the GIL switch interval, transport timings reaching the config, one name
for each flag across commands, and a model a command cannot serve ending it with a message."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import pytest
import torch

from bench.tls_certs import make_certs
from pdserve import cli, generate, launcher_args
from pdserve.cli import DEFAULT_GIL_SWITCH_INTERVAL_MS, add_serve_args, apply_gil_switch_interval
from pdserve.config_builder import runner_config_from_args, server_config_from_args
from pdserve.router import cli as router_cli
from pdserve.tls import TLSConfig
from tests.model.checkpoints import convert_checkpoint, write_checkpoint


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


def test_the_tls_flags_reach_the_api_the_bootstrap_port_registration_and_the_router(
    tmp_path,
) -> None:
    certs = make_certs(tmp_path / "certs")
    tls = ("--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key),
           "--ssl-ca-certs", str(certs.ca))  # fmt: skip
    cfg = server_config_from_args(parse("--model", str(tmp_path), "--router", "https://r:1", *tls))
    expected = TLSConfig(str(certs.cert), str(certs.key), str(certs.ca))
    assert cfg.tls == cfg.transport.tls == cfg.registration.tls == expected
    router = router_cli.config_from_args(router_cli.build_parser().parse_args(list(tls)))
    assert router.tls == expected and router.tls.scheme == "https"
    with pytest.raises(ValueError, match="--ssl-certfile: no such file"):
        server_config_from_args(parse("--model", str(tmp_path), "--ssl-certfile", "/nope.pem"))
    assert router_cli.main(["--ssl-certfile", str(certs.ca)]) == 2  # a cert without its key


def test_a_non_positive_bootstrap_timeout_is_a_usage_error(tmp_path) -> None:
    args = parse("--model", str(tmp_path), "--bootstrap-connect-timeout", "0")
    with pytest.raises(ValueError, match="connect_timeout_s"):
        server_config_from_args(args)


def test_the_request_deadline_is_derived_by_default_and_its_budget_is_flags(tmp_path) -> None:
    default = server_config_from_args(parse("--model", str(tmp_path))).engine.deadlines
    assert default.request_s is None and default.overall_s(100) == 60.0 + 100 * 1.0
    args = parse(
        "--model", str(tmp_path), "--timeout-request-base", "5", "--timeout-per-token", "0.1"
    )
    assert server_config_from_args(args).engine.deadlines.overall_s(100) == pytest.approx(15.0)
    with pytest.raises(ValueError, match="deadline"):
        server_config_from_args(parse("--model", str(tmp_path), "--timeout-request", "0"))


def test_decode_threads_default_to_auto_and_a_count_reaches_the_runner_config(tmp_path) -> None:
    auto = server_config_from_args(parse("--model", str(tmp_path)))
    assert auto.runner.decode_threads is None  # measured at start-up
    args = parse("--model", str(tmp_path), "--num-threads", "2", "--decode-threads", "1")
    runner = server_config_from_args(args).runner
    assert (runner.num_threads, runner.decode_threads) == (2, 1)
    assert parse("--decode-threads", "auto").decode_threads is None


@pytest.mark.parametrize("value", ["0", "-1", "many"])
def test_decode_threads_must_be_auto_or_a_positive_count(value: str) -> None:
    with pytest.raises(SystemExit):
        parse("--decode-threads", value)


def _parsers() -> dict[str, Callable[[list[str]], argparse.Namespace]]:
    return {
        "serve": lambda argv: parse(*argv),
        "up": launcher_args.parse_args,
        "generate": generate._parse_args,
    }


RUNNER_FLAGS = ["--dtype", "float32", "--page-size", "8", "--kv-cache-mb", "32",
                "--max-num-seqs", "4", "--max-prefill-tokens", "256", "--max-model-len", "128",
                "--num-threads", "2"]  # fmt: skip
RUNNER_VALUES = {"dtype": "float32", "page_size": 8, "kv_cache_mb": 32, "max_num_seqs": 4,
                 "max_prefill_tokens": 256, "max_model_len": 128, "num_threads": 2}  # fmt: skip


@pytest.mark.parametrize("command", ["serve", "up", "generate"])
def test_every_model_loading_command_takes_the_same_runner_flags(command: str) -> None:
    parse_command = _parsers()[command]
    args = parse_command(RUNNER_FLAGS)
    assert {k: getattr(args, k) for k in RUNNER_VALUES} == RUNNER_VALUES
    assert parse_command([]).dtype == "auto"


def test_generate_runner_flags_reach_its_runner_config(tmp_path) -> None:
    args = generate._parse_args(["--model", str(tmp_path), *RUNNER_FLAGS])
    runner = runner_config_from_args(args)
    assert (runner.dtype, runner.page_size, runner.kv_cache_bytes) == ("float32", 8, 32 << 20)
    assert (runner.max_num_seqs, runner.max_model_len, runner.num_threads) == (4, 128, 2)
    assert runner_config_from_args(generate._parse_args([])).dtype == "auto"


def test_generate_old_kv_cache_mib_still_works_with_a_deprecation_warning(capsys) -> None:
    assert generate._parse_args(["--kv-cache-mib", "48"]).kv_cache_mb == 48
    assert "--kv-cache-mib is deprecated; use --kv-cache-mb" in capsys.readouterr().err


def test_serve_and_router_share_the_body_limit_and_api_key_flags(capsys) -> None:
    argv = ["--max-body-kb", "64", "--api-key", "k"]
    worker = server_config_from_args(parse("--model", "m", *argv))
    router = router_cli.config_from_args(router_cli.build_parser().parse_args(argv))
    assert worker.api.max_body_bytes == router.max_body_bytes == 64 << 10
    assert worker.api.api_key == router.api_key == "k"
    old = router_cli.build_parser().parse_args(["--max-body-bytes", "5000"])
    assert router_cli.config_from_args(old).max_body_bytes == 5000
    assert "--max-body-bytes is deprecated; use --max-body-kb" in capsys.readouterr().err


def test_an_unset_model_is_pdserve_model_then_the_demo(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PDSERVE_MODEL", str(tmp_path))
    assert server_config_from_args(parse()).runner.model_dir == str(tmp_path)
    assert launcher_args.cluster_config_from_args(launcher_args.parse_args([])).model_dir == str(
        tmp_path
    )


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    src = write_checkpoint(tmp_path_factory.mktemp("llama") / "plain", "llama")
    quant = {"quant_method": "gptq", "bits": 4}
    dst = src.parent / "gptq"
    return str(convert_checkpoint(src, dst, torch.float32, "float32", quantization_config=quant))


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["serve", "--port", "0"], "pdserve serve"),
        (["generate", "--prompt", "hi"], "pdserve generate"),
        (["up"], "pdserve up"),
    ],
)
def test_a_quantized_checkpoint_ends_the_command_with_its_method_named(
    restore_switch_interval: None, quantized_dir: str, capsys, argv: list[str], prog: str
) -> None:
    assert cli.main([*argv, "--model", quantized_dir]) == 2
    err = capsys.readouterr().err
    assert f"{prog}: the checkpoint is quantized (quantization_config.quant_method 'gptq')" in err
    assert "Traceback" not in err


def test_serve_and_router_take_the_same_log_level_and_parent_pid_flags() -> None:
    argv = ["--log-level", "debug", "--parent-pid", "123"]
    for args in (parse(*argv), router_cli.build_parser().parse_args(argv)):
        assert (args.log_level, args.parent_pid) == ("debug", 123)
    assert generate._parse_args(["--log-level", "info"]).log_level == "info"


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


def test_only_the_prefill_role_runs_no_decode_steps(tmp_path) -> None:
    """A prefill worker never decodes: it captures no decode graphs (seconds of start-up and a
    memory reserve on a GPU)."""
    args = generate._parse_args(["--model", str(tmp_path)])
    roles = {r: runner_config_from_args(args, r) for r in ("prefill", "decode", "colocated")}
    assert {r: c.runs_decode_steps for r, c in roles.items()} == {
        "prefill": False, "decode": True, "colocated": True,
    }  # fmt: skip
