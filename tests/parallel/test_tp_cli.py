"""``--tensor-parallel-size`` (``-tp``) on the commands that load a model: what it sets (every
role; ``pdserve up``'s ``--prefill-tp``/``--decode-tp``), and what is refused at argument time (a
size below 1, one the model does not split into). In-process: no model is loaded."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdserve.cli import add_serve_args, main
from pdserve.config_builder import server_config_from_args
from pdserve.launcher_args import cluster_config_from_args, parse_args
from tests.model.checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")  # 4 heads, 2 KV heads


def _serve_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "-tp"])
def test_a_colocated_worker_s_runner_gets_the_tp_size(flag: str, model_dir: Path) -> None:
    config = server_config_from_args(_serve_args("--model", str(model_dir), flag, "2"))
    assert config.runner.tensor_parallel_size == 2


def test_the_tp_size_defaults_to_one(model_dir: Path) -> None:
    assert (
        server_config_from_args(_serve_args("--model", str(model_dir))).runner.tensor_parallel_size
        == 1
    )


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_pd_worker_s_runner_gets_the_tp_size(role: str, model_dir: Path) -> None:
    """A prefill and a decode of different sizes pair: every engine's pages are TP1's."""
    args = _serve_args("--role", role, "--model", str(model_dir), "-tp", "2")
    assert server_config_from_args(args).runner.tensor_parallel_size == 2


def test_tp1_on_a_pd_worker_is_accepted(model_dir: Path) -> None:
    args = _serve_args("--role", "decode", "--model", str(model_dir), "-tp", "1")
    assert server_config_from_args(args).runner.tensor_parallel_size == 1


@pytest.mark.parametrize("command", ["serve", "generate", "up"])
@pytest.mark.parametrize("size", ["0", "-1", "two"])
def test_a_tp_size_below_one_is_a_usage_error(
    command: str, size: str, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--model", str(model_dir), "-tp", size])
    assert exit_.value.code == 2
    assert "--tensor-parallel-size/-tp" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "sizes"),
    [
        ([], ("1", "1")),
        (["-tp", "2"], ("2", "2")),
        (["--prefill-tp", "2"], ("2", "1")),
        (["-tp", "2", "--decode-tp", "1"], ("2", "1")),
    ],
)
def test_up_gives_each_role_its_tp_size(
    argv: list[str], sizes: tuple[str, str], model_dir: Path
) -> None:
    config = cluster_config_from_args(parse_args(["--model", str(model_dir), *argv]))
    for role_args, size in zip((config.prefill_args, config.decode_args), sizes, strict=True):
        assert role_args[role_args.index("-tp") + 1] == size


def test_a_tp_size_the_model_does_not_split_into_is_refused_at_argument_time(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "-tp", "8"]) == 2
    assert "tensor_parallel_size 8 does not split this model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", str(model_dir), "-tp", "8"])
    assert exit_.value.code == 2
    assert "does not split this model" in capsys.readouterr().err


def test_tp2_on_cuda_is_refused_at_argument_time(model_dir: Path) -> None:
    args = _serve_args("--model", str(model_dir), "-tp", "2")
    args.device = "cuda:0"  # as --device would give it on a CUDA machine
    with pytest.raises(ValueError, match="only CPU engines split yet"):
        server_config_from_args(args)
