"""``pdserve router`` flags map onto RouterConfig."""

from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp

from pdserve.envs import Env
from pdserve.router.cli import build_parser, config_from_args, main


def test_flags_build_the_config():
    args = build_parser().parse_args(
        [
            "--port", "31000",
            "--prefill", "http://127.0.0.1:30001",
            "--prefill", "http://127.0.0.1:30011",
            "--decode", "http://127.0.0.1:30002",
            "--worker", "http://127.0.0.1:30003",
            "--policy", "power_of_two",
            "--max-attempts", "5",
            "--first-byte-timeout", "7.5",
            "--api-key", "k",
        ]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert cfg.port == 31000 and cfg.policy == "power_of_two" and cfg.max_attempts == 5
    assert cfg.prefill_urls == ("http://127.0.0.1:30001", "http://127.0.0.1:30011")
    assert cfg.decode_urls == ("http://127.0.0.1:30002",)
    assert cfg.worker_urls == ("http://127.0.0.1:30003",)
    assert cfg.first_byte_timeout_s == 7.5
    assert cfg.api_key == cfg.worker_api_key == "k"


def test_migration_and_fallback_flags():
    defaults = config_from_args(build_parser().parse_args([]))
    assert defaults.migration_limit == 3 and not defaults.enforce_disagg
    args = build_parser().parse_args(["--migration-limit", "0", "--enforce-disagg"])
    cfg = config_from_args(args)
    assert cfg.migration_limit == 0 and cfg.enforce_disagg
    assert main(["--migration-limit", "-1"]) == 2


def test_env_api_key_is_the_default_and_worker_key_can_differ():
    args = build_parser().parse_args(["--worker-api-key", "w"])
    cfg = config_from_args(args, Env(api_key="from-env"))
    assert cfg.api_key == "from-env" and cfg.worker_api_key == "w"
    assert config_from_args(build_parser().parse_args([])).api_key is None


def test_main_rejects_bad_worker_url_with_status_2(capsys):
    assert main(["--decode", "not-a-url"]) == 2
    assert "worker url" in capsys.readouterr().err


async def test_cli_serves_until_sigint(make_worker):
    decode = await make_worker("colocated")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.router", "--port", "0", "--worker", decode.url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        url = line.decode().rsplit(" ", 1)[-1].strip()
        assert url.startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/health") as resp:
                assert resp.status == 200
            async with session.get(url + "/workers") as resp:
                assert (await resp.json())["data"][0]["url"] == decode.url
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
