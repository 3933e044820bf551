"""README command 1: `pdserve up` starts prefill + decode + router, answers a chat completion
through the official openai client, and Ctrl-C stops every process it started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import READY_TIMEOUT_S, free_port


def _wait_for_line(log: Path, text: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        assert proc.poll() is None, f"pdserve up exited {proc.returncode}:\n{log.read_text()}"
        time.sleep(0.2)  # poll of the launcher's log with a deadline
    raise TimeoutError(f"no {text!r} after {timeout_s} s:\n{log.read_text()[-4000:]}")


def _is_listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_all_closed(ports: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (open_ports := [p for p in ports if _is_listening(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)  # poll with a deadline
    return open_ports


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "term"])
def test_up_serves_a_chat_completion_and_ctrl_c_or_sigterm_stops_every_process(
    tmp_path: Path, demo_model_dir: Path, stop_signal: signal.Signals
) -> None:
    ports = {name: free_port() for name in ("router", "prefill", "decode", "bootstrap")}
    log = tmp_path / "up.log"
    argv = [sys.executable, "-m", "pdserve", "up", "--model", str(demo_model_dir),
            "--kv-cache-mb", "64", *(f"--{n}-port={p}" for n, p in ports.items())]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_line(log, "PD cluster ready", proc, READY_TIMEOUT_S)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{ports['router']}/v1", api_key="none", timeout=120
        )
        reply = client.chat.completions.create(
            model=demo_model_dir.name,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=8,
        )
        assert reply.choices[0].message.content
        assert reply.usage is not None and reply.usage.completion_tokens >= 1

        os.kill(proc.pid, stop_signal)  # SIGINT is what Ctrl-C sends
        assert proc.wait(timeout=60) == 0
        assert _wait_all_closed(list(ports.values()), timeout_s=30) == []
    finally:  # on failure, let the launcher stop its children (they run in their own sessions)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
