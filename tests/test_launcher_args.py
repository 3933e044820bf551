"""`pdserve up` passes every model and engine flag it accepts on to both workers."""

from __future__ import annotations

import os

import pytest

from pdserve.cli import add_serve_args
from pdserve.launcher import cluster_config_from_args, parse_args, shared_host_prefill_threads


def _serve_parse(argv: list[str]):
    import argparse  # noqa: PLC0415

    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(argv)


def test_every_worker_flag_given_to_up_reaches_the_workers(tmp_path) -> None:
    argv = ["--model", str(tmp_path), "--dtype", "float32", "--page-size", "8",
            "--kv-cache-mb", "32", "--max-num-seqs", "5", "--max-prefill-tokens", "512",
            "--max-model-len", "256", "--num-threads", "2", "--decode-threads", "1"]  # fmt: skip
    cfg = cluster_config_from_args(parse_args(argv))
    worker = _serve_parse(["--model", cfg.model_dir, *cfg.extra_worker_args])
    expected = {"dtype": "float32", "page_size": 8, "kv_cache_mb": 32, "max_num_seqs": 5,
                "max_prefill_tokens": 512, "max_model_len": 256, "num_threads": 2,
                "decode_threads": 1}  # fmt: skip
    assert {k: getattr(worker, k) for k in expected} == expected


def test_by_default_decode_measures_its_threads_and_prefill_gets_half_the_cores(tmp_path) -> None:
    cfg = cluster_config_from_args(parse_args(["--model", str(tmp_path)]))
    decode = _serve_parse(["--model", cfg.model_dir, *cfg.extra_worker_args])
    assert decode.num_threads is None and decode.decode_threads is None
    prefill = _serve_parse(["--model", cfg.model_dir, *cfg.extra_worker_args, *cfg.prefill_args])
    assert prefill.num_threads == shared_host_prefill_threads(len(os.sched_getaffinity(0)))


def test_a_given_thread_count_reaches_both_workers_unchanged(tmp_path) -> None:
    cfg = cluster_config_from_args(parse_args(["--model", str(tmp_path), "--num-threads", "3"]))
    assert cfg.prefill_args == ()
    assert _serve_parse(["--model", cfg.model_dir, *cfg.extra_worker_args]).num_threads == 3


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (3, 1), (8, 4), (64, 32)])
def test_prefill_share_is_half_the_cores_and_at_least_one(cores: int, threads: int) -> None:
    assert shared_host_prefill_threads(cores) == threads
