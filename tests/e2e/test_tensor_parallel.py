"""A colocated ``pdserve serve --tensor-parallel-size 2`` as a real process: the official openai
client gets the TP1 server's greedy text; a rank SIGKILLed under a stream fails that stream with
the cause named, later requests are refused (or find the server gone), and the server exits
non-zero within a bounded time (demo model, loopback)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import pytest
from openai import OpenAI

from tests.e2e.conftest import Proc, stream_completion, worker
from tests.e2e.procs import running

pytestmark = pytest.mark.slow

EXIT_TIMEOUT_S = 30.0
PROMPTS = ["Hello there", "The capital of France is", "a"]


def _tp_worker(tmp: Path, model: Path, tp: int) -> Proc:
    return worker(tmp, f"colocated-tp{tp}", "colocated", model, "--tensor-parallel-size", str(tp))


def rank_pids(server_pid: int) -> list[int]:
    """The server's tensor-parallel rank processes (children of any of its threads: the model
    loads, and starts the ranks, on the runner thread)."""
    pids = []
    for task in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    return [p for p in pids if b"pdserve.parallel.rank_main" in _cmdline(p)]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def _greedy_texts(url: str) -> list[str]:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    texts = []
    for prompt in PROMPTS:
        done = client.completions.create(
            model="demo",
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        texts.append(done.choices[0].text)
        chat = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": prompt}], max_tokens=8,
            temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        texts.append(chat.choices[0].message.content or "")
    return texts


def test_a_tp2_colocated_server_gives_the_openai_client_tp1_s_greedy_text(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    tp1, tp2 = _tp_worker(tmp_path, demo_model_dir, 1), _tp_worker(tmp_path, demo_model_dir, 2)
    with running([tp1, tp2]):
        assert tp2.proc is not None and len(rank_pids(tp2.proc.pid)) == 1
        expected = _greedy_texts(tp1.url)
        assert all(expected) and _greedy_texts(tp2.url) == expected


async def test_a_killed_rank_fails_the_stream_in_flight_and_the_server_exits_non_zero(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    proc = _tp_worker(tmp_path, demo_model_dir, 2)
    with running([proc]):
        assert proc.proc is not None
        [rank1] = rank_pids(proc.proc.pid)
        body = {"model": "demo", "prompt": "Hello", "max_tokens": 3000, "ignore_eos": True}
        first = asyncio.Event()
        async with aiohttp.ClientSession() as session:
            stream = asyncio.create_task(
                stream_completion(session, proc.url, body, timeout_s=120, first_event=first)
            )
            await asyncio.wait_for(first.wait(), 120)
            os.kill(rank1, signal.SIGKILL)
            res = await stream
            assert res.is_clean_error, res
            assert res.error["code"] == "engine_failed"
            assert "tensor-parallel rank 1 exited (status -9)" in res.error["message"]
            later = await stream_completion(session, proc.url, body, timeout_s=60)
            # refused with the cause while the server stops, or the server is gone already
            if later.exception is None:  # answered, not cut: a 503 naming the cause
                assert later.status == 503, later
                assert "engine failed: tensor-parallel rank 1" in later.error["error"]["message"]
        returncode = await asyncio.to_thread(proc.proc.wait, EXIT_TIMEOUT_S)
        assert returncode == 1, proc.log_tail()
        assert "pdserve serve: engine failed: tensor-parallel rank 1 exited" in proc.log_text()
