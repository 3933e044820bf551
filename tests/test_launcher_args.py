"""`pdserve up` passes every model and engine flag it accepts on to both workers."""

from __future__ import annotations

from pdserve.cli import add_serve_args
from pdserve.launcher import child_specs, cluster_config_from_args, parse_args


def _serve_parse(argv: list[str]):
    import argparse  # noqa: PLC0415

    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(argv)


def test_every_worker_flag_given_to_up_reaches_the_workers(tmp_path) -> None:
    argv = ["--model", str(tmp_path), "--dtype", "float32", "--page-size", "8",
            "--kv-cache-mb", "32", "--max-num-seqs", "5", "--max-prefill-tokens", "512",
            "--max-model-len", "256", "--num-threads", "2", "--decode-threads", "1",
            "--no-chunked-prefill", "--no-prefix-caching"]  # fmt: skip
    cfg = cluster_config_from_args(parse_args(argv))
    worker = _serve_parse(["--model", cfg.model_dir, *cfg.extra_worker_args])
    expected = {"dtype": "float32", "page_size": 8, "kv_cache_mb": 32, "max_num_seqs": 5,
                "max_prefill_tokens": 512, "max_model_len": 256, "num_threads": 2,
                "decode_threads": 1, "chunked_prefill": False, "prefix_caching": False}  # fmt: skip
    assert {k: getattr(worker, k) for k in expected} == expected


def test_by_default_workers_measure_their_threads_and_share_one_cpu_lease(tmp_path) -> None:
    cfg = cluster_config_from_args(parse_args(["--model", str(tmp_path)]))
    assert cfg.cpu_lease_path
    workers = [argv for name, argv, _ in child_specs(cfg) if name != "router"]
    assert len(workers) == 2
    for argv in workers:
        worker = _serve_parse(argv[1:])
        assert worker.num_threads is None and worker.decode_threads is None
        assert worker.cpu_lease == cfg.cpu_lease_path


def test_no_cpu_lease_lets_the_workers_compute_at_once(tmp_path) -> None:
    cfg = cluster_config_from_args(parse_args(["--model", str(tmp_path), "--no-cpu-lease"]))
    assert cfg.cpu_lease_path is None
    assert all("--cpu-lease" not in argv for _, argv, _ in child_specs(cfg))


def test_a_given_thread_count_reaches_both_workers_unchanged(tmp_path) -> None:
    cfg = cluster_config_from_args(parse_args(["--model", str(tmp_path), "--num-threads", "3"]))
    assert _serve_parse(["--model", cfg.model_dir, *cfg.extra_worker_args]).num_threads == 3


def test_prefix_caching_and_chunked_prefill_are_on_unless_turned_off(tmp_path) -> None:
    cfg = cluster_config_from_args(parse_args(["--model", str(tmp_path)]))
    worker = _serve_parse(["--model", cfg.model_dir, *cfg.extra_worker_args])
    assert worker.prefix_caching and worker.chunked_prefill
    vllm_names = _serve_parse(["--max-num-batched-tokens", "256", "--no-enable-prefix-caching"])
    assert vllm_names.max_prefill_tokens == 256 and not vllm_names.prefix_caching
