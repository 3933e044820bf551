"""`pdserve up` passes every flag it accepts on to its children, and stops them by drain."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from bench.tls_certs import make_certs
from pdserve.cli import add_serve_args
from pdserve.launcher import Child, child_specs, stop_cluster
from pdserve.launcher_args import cluster_config_from_args, parse_args


def _serve_parse(argv: list[str]):
    import argparse  # noqa: PLC0415

    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(argv)


def test_every_worker_flag_given_to_up_reaches_the_workers(tmp_path) -> None:
    argv = ["--model", str(tmp_path), "--dtype", "float32", "--page-size", "8",
            "--kv-cache-mb", "32", "--max-num-seqs", "5", "--max-prefill-tokens", "512",
            "--max-model-len", "256", "--num-threads", "2", "--decode-threads", "1",
            "--no-chunked-prefill", "--no-prefix-caching",
            "--reasoning-parser", "qwen3"]  # fmt: skip
    cfg = cluster_config_from_args(parse_args(argv))
    worker = _serve_parse(["--model", cfg.model_dir, *cfg.extra_worker_args])
    expected = {"dtype": "float32", "page_size": 8, "kv_cache_mb": 32, "max_num_seqs": 5,
                "max_prefill_tokens": 512, "max_model_len": 256, "num_threads": 2,
                "decode_threads": 1, "chunked_prefill": False, "prefix_caching": False,
                "reasoning_parser": "qwen3"}  # fmt: skip
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


def test_each_cluster_gets_its_own_bootstrap_token_in_the_workers_environment(
    tmp_path, monkeypatch
) -> None:
    from pdserve import launcher  # noqa: PLC0415
    from pdserve.config_builder import server_config_from_args  # noqa: PLC0415
    from pdserve.envs import BOOTSTRAP_TOKEN_ENV  # noqa: PLC0415

    a, b = (cluster_config_from_args(parse_args(["--model", str(tmp_path)])) for _ in range(2))
    assert a.bootstrap_token and a.bootstrap_token != b.bootstrap_token
    assert a.bootstrap_token not in repr(a)
    assert all(a.bootstrap_token not in " ".join(argv) for _, argv, _ in child_specs(a))
    spawned: list[dict[str, str]] = []
    monkeypatch.setattr(launcher, "_popen", lambda name, argv, env: spawned.append(env))
    launcher.start_cluster(a, [])
    assert [env[BOOTSTRAP_TOKEN_ENV] for env in spawned] == [a.bootstrap_token] * 3
    monkeypatch.setenv(BOOTSTRAP_TOKEN_ENV, a.bootstrap_token)  # what a worker child sees
    prefill_argv = next(argv for name, argv, _ in child_specs(a) if name == "prefill")
    config = server_config_from_args(_serve_parse(prefill_argv[1:]))
    assert config.transport.bootstrap_token == a.bootstrap_token


def test_only_the_router_holds_the_workers_key_and_the_users_key_reaches_only_the_router(
    tmp_path, monkeypatch
) -> None:
    from pdserve import launcher  # noqa: PLC0415
    from pdserve.config_builder import server_config_from_args  # noqa: PLC0415
    from pdserve.envs import read_env  # noqa: PLC0415
    from pdserve.router import cli as router_cli  # noqa: PLC0415

    monkeypatch.setenv("PDSERVE_REGISTRATION_TOKEN", "not-for-children")
    argv = ["--model", str(tmp_path), "--api-key", "user-key", "--admin-api-key", "admin-key"]
    cfg = cluster_config_from_args(parse_args(argv))
    assert cfg.worker_api_key and cfg.worker_api_key not in repr(cfg) + "user-key"
    specs = {name: argv for name, argv, _ in child_specs(cfg)}
    assert all(cfg.worker_api_key not in " ".join(a) and "user-key" not in " ".join(a)
               for a in specs.values())  # fmt: skip
    for name, child_argv in specs.items():
        env = launcher.child_secrets(cfg, name)
        assert "PDSERVE_REGISTRATION_TOKEN" not in env  # the supervisor's own secrets stay
        monkeypatch.setattr("os.environ", env)  # what the child reads
        if name == "router":
            router = router_cli.config_from_args(
                router_cli.build_parser().parse_args(child_argv[1:]), read_env()
            )
            assert (router.api_key, router.worker_api_key) == ("user-key", cfg.worker_api_key)
            assert router.admin_api_key == "admin-key"
        else:
            worker = server_config_from_args(_serve_parse(child_argv[1:]))
            assert worker.api.api_key == cfg.worker_api_key  # not the user's key
            assert worker.api.admin_api_key == "admin-key"


def test_drain_timeout_reaches_every_child(tmp_path) -> None:
    cfg = cluster_config_from_args(parse_args(["--model", str(tmp_path), "--drain-timeout", "7"]))
    specs = {name: argv for name, argv, _ in child_specs(cfg)}
    assert set(specs) == {"prefill", "decode", "router"}
    for argv in specs.values():
        assert argv[argv.index("--drain-timeout") + 1] == "7.0"
    assert _serve_parse(specs["decode"][1:]).drain_timeout == 7.0


def test_stopping_gives_a_draining_child_its_time_before_any_kill(tmp_path) -> None:

    ready = tmp_path / "ready"
    # A child that, like a draining worker, takes a while after SIGTERM and then exits 0.
    script = (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.0), sys.exit(0)))\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        deadline = 30.0
        started = time.monotonic()
        while not ready.exists():  # its SIGTERM handler is installed
            assert time.monotonic() - started < deadline and proc.poll() is None
            time.sleep(0.01)  # poll with a deadline (a subprocess start)
        # stop_cluster ignores SIGINT/SIGTERM for good (it is the launcher's last act): restore.
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            stop_cluster([Child("worker", "http://x:1", [], proc)], grace_s=20.0)
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
        assert proc.returncode == 0  # drained and exited by itself, not SIGKILLed
    finally:
        if proc.poll() is None:
            proc.kill()


def test_prefix_caching_and_chunked_prefill_are_on_unless_turned_off(tmp_path) -> None:
    cfg = cluster_config_from_args(parse_args(["--model", str(tmp_path)]))
    worker = _serve_parse(["--model", cfg.model_dir, *cfg.extra_worker_args])
    assert worker.prefix_caching and worker.chunked_prefill
    vllm_names = _serve_parse(["--max-num-batched-tokens", "256", "--no-enable-prefix-caching"])
    assert vllm_names.max_prefill_tokens == 256 and not vllm_names.prefix_caching


def test_per_role_counts_start_that_many_workers_on_their_own_ports(tmp_path) -> None:
    argv = ["--model", str(tmp_path), "--num-prefill", "2", "--num-decode", "3",
            "--policy", "cache_aware"]  # fmt: skip
    specs = {name: (argv, url) for name, argv, url in child_specs(cluster_config_from_args(
        parse_args(argv)))}  # fmt: skip
    assert list(specs) == ["prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2", "router"]
    workers = {name: _serve_parse(a[1:]) for name, (a, _) in specs.items() if name != "router"}
    assert [w.port for w in workers.values()] == [30001, 30011, 30002, 30012, 30022]
    assert [workers[f"prefill-{i}"].bootstrap_port for i in range(2)] == [8998, 8999]
    router_argv = specs["router"][0]
    assert router_argv[router_argv.index("--policy") + 1] == "cache_aware"
    named = [
        router_argv[i + 1] for i, a in enumerate(router_argv) if a in ("--prefill", "--decode")
    ]
    assert named == [url for name, (_, url) in specs.items() if name != "router"]


def test_counts_whose_ports_collide_are_refused(tmp_path, capsys) -> None:
    from pdserve import launcher  # noqa: PLC0415

    # The second prefill would take the router's port.
    argv = ["--model", str(tmp_path), "--num-prefill", "2", "--router-port", "30011"]
    assert launcher.main(argv) == 2
    assert "share a port" in capsys.readouterr().err


def test_the_tls_flags_reach_every_child_and_their_urls_are_https(tmp_path) -> None:
    certs = make_certs(tmp_path / "certs")
    tls = ["--ssl-certfile", str(certs.cert), "--ssl-keyfile", str(certs.key),
           "--ssl-ca-certs", str(certs.ca)]  # fmt: skip
    cfg = cluster_config_from_args(parse_args(["--model", str(tmp_path), *tls]))
    specs = {name: (argv, url) for name, argv, url in child_specs(cfg)}
    for argv, url in specs.values():
        assert url.startswith("https://127.0.0.1:")
        assert [argv[argv.index(f) + 1] for f in tls[::2]] == tls[1::2]
    router_argv = specs["router"][0]
    assert router_argv[router_argv.index("--prefill") + 1] == specs["prefill"][1]
    worker = _serve_parse(specs["decode"][0][1:])
    assert (worker.ssl_certfile, worker.ssl_ca_certs) == (str(certs.cert), str(certs.ca))
    plain = child_specs(cluster_config_from_args(parse_args(["--model", str(tmp_path)])))
    assert all(url.startswith("http://") and "--ssl-certfile" not in argv
               for _, argv, url in plain)  # fmt: skip


def test_up_hands_its_tool_call_parser_to_the_workers(tmp_path) -> None:
    argv = ["--model", str(tmp_path), "--tool-call-parser", "qwen3_coder"]
    cfg = cluster_config_from_args(parse_args(argv))
    worker = _serve_parse(["--model", cfg.model_dir, *cfg.extra_worker_args])
    assert worker.tool_call_parser == "qwen3_coder"


def test_up_hands_its_speculative_flags_to_the_decode_workers_only(tmp_path) -> None:
    argv = ["--model", str(tmp_path), "--speculative-method", "ngram",
            "--num-speculative-tokens", "3", "--no-speculative-adaptive"]  # fmt: skip
    specs = {
        name: argv for name, argv, _ in child_specs(cluster_config_from_args(parse_args(argv)))
    }
    decode = _serve_parse(specs["decode"][1:])
    assert (decode.speculative_method, decode.num_speculative_tokens) == ("ngram", 3)
    assert decode.speculative_adaptive is False
    assert _serve_parse(specs["prefill"][1:]).speculative_method is None
    plain = child_specs(cluster_config_from_args(parse_args(["--model", str(tmp_path)])))
    assert all("--speculative-method" not in argv for _, argv, _ in plain)
