"""README command 1: `pdserve up` starts prefill + decode + router, answers a chat completion
through the official openai client, and Ctrl-C stops every process it started, also when it was
started with SIGINT ignored (a non-interactive shell's background job); when it is SIGKILLed, its
children exit too."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import READY_TIMEOUT_S, free_port
from tests.test_lifetime import is_running, wait_gone


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


def _start_up(
    tmp_path: Path, demo_model_dir: Path, ignore_sigint: bool = False
) -> tuple[subprocess.Popen[bytes], Path, dict[str, int]]:
    ports = {name: free_port() for name in ("router", "prefill", "decode", "bootstrap")}
    log = tmp_path / "up.log"
    argv = [sys.executable, "-m", "pdserve", "up", "--model", str(demo_model_dir),
            "--kv-cache-mb", "64", *(f"--{n}-port={p}" for n, p in ports.items())]  # fmt: skip

    def ignore() -> None:  # what a background job of a non-interactive shell inherits
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=ignore if ignore_sigint else None,
        )  # fmt: skip
    return proc, log, ports


def _child_pids(log: Path) -> dict[str, int]:
    found = re.findall(r"\[up\] started (\w+) \(pid (\d+)\)", log.read_text(errors="replace"))
    return {name: int(pid) for name, pid in found}


@pytest.mark.parametrize(
    ("stop_signal", "ignore_sigint"),
    [(signal.SIGINT, False), (signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["ctrl-c", "ctrl-c-started-with-sigint-ignored", "term"],
)
def test_up_serves_a_chat_completion_and_ctrl_c_or_sigterm_stops_every_process(
    tmp_path: Path, demo_model_dir: Path, stop_signal: signal.Signals, ignore_sigint: bool
) -> None:
    proc, log, ports = _start_up(tmp_path, demo_model_dir, ignore_sigint)
    try:
        _wait_for_line(log, "PD cluster ready", proc, READY_TIMEOUT_S)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{ports['router']}/v1", api_key="none", timeout=120
        )
        reply = client.chat.completions.create(
            model=demo_model_dir.name,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=8,
            temperature=0,  # greedy: a sampled first token may be EOS, an empty reply
        )
        assert reply.choices[0].message.content
        assert reply.usage is not None and reply.usage.completion_tokens >= 1

        os.kill(proc.pid, stop_signal)  # SIGINT is what Ctrl-C sends
        assert proc.wait(timeout=60) == 0
        assert _wait_all_closed(list(ports.values()), timeout_s=30) == []
        assert wait_gone(list(_child_pids(log).values()), timeout_s=10) == []
    finally:  # on failure, let the launcher stop its children (they run in their own sessions)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def test_children_exit_and_free_their_ports_when_up_is_sigkilled(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    proc, log, ports = _start_up(tmp_path, demo_model_dir)
    children: dict[str, int] = {}
    try:
        _wait_for_line(log, "PD cluster ready", proc, READY_TIMEOUT_S)
        children = _child_pids(log)
        assert sorted(children) == ["decode", "prefill", "router"]
        proc.kill()  # no handler runs: only the children's own mechanisms can end them
        proc.wait(timeout=30)
        assert wait_gone(list(children.values()), timeout_s=45) == [], log.read_text()[-4000:]
        assert _wait_all_closed(list(ports.values()), timeout_s=30) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in children.values():  # a failed run must not leave servers behind
            if is_running(pid):
                os.killpg(pid, signal.SIGKILL)
